"""The scheduler's picture of the device: when the launched batches are predicted to leave it,
how long a launch takes the host, and how long a finished batch really ran."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

# Pipelined launches: the next batch is formed this many launch times plus a margin (s)
# before the device is predicted to be free.
LAUNCH_LEAD_FACTOR = 2.0
LAUNCH_LEAD_MARGIN = 0.002
LAUNCH_WINDOW = 16  # recent launches whose median is the launch time
DEFAULT_LAUNCH_SECONDS = 0.003


@dataclass
class DeviceTimeline:
    """Predicted and measured times of the batches in flight (``time.perf_counter()`` s).

    Attributes:
        free_at: when the launched batches are predicted to have left the device.
        predicted_end: id(batch) -> when that batch should end.
        launch_times: recent launches' host seconds, newest last.
        last_finished: when the last batch finished.
    """

    free_at: float = 0.0
    predicted_end: dict[int, float] = field(default_factory=dict)
    launch_times: list[float] = field(default_factory=list)
    last_finished: float = 0.0

    def start_of_next(self, now: float, running: bool) -> float:
        """When a batch launched now starts on the device: behind those running, if any."""
        return max(now, self.free_at) if running else now

    def launched(self, batch_id: int, end: float) -> None:
        """A batch predicted to end at ``end`` was launched behind the others."""
        self.free_at = end
        self.predicted_end[batch_id] = end

    def finished(self, batch_id: int, now: float, running: bool) -> None:
        """A batch ended at ``now``: the ones behind it start that much sooner or later."""
        predicted = self.predicted_end.pop(batch_id, None)
        if not running:
            self.free_at = now
        elif predicted is not None:
            self.free_at = max(now, self.free_at + now - predicted)

    def record_launch(self, seconds: float) -> None:
        self.launch_times.append(seconds)
        del self.launch_times[:-LAUNCH_WINDOW]

    def launch_seconds(self) -> float:
        """Typical launch time: the median of the recent ones (a launch that captured a
        graph or waited for a lane is an outlier, not the rule)."""
        if not self.launch_times:
            return DEFAULT_LAUNCH_SECONDS
        return statistics.median(self.launch_times)

    def lead(self) -> float:
        """How long before the device is free the next batch should be formed (s)."""
        return LAUNCH_LEAD_FACTOR * self.launch_seconds() + LAUNCH_LEAD_MARGIN

    def run_seconds(self, started: float, finished: float, device_s: float | None) -> float:
        """How long a batch took, for the latency model: from its launch, less the time it
        queued on the device behind the batch finished before it, but never less than the
        device time the engine measured (``device_s``; batches on other streams run side
        by side, so the one finished before need not have been ahead of it)."""
        behind = finished - max(started, self.last_finished)
        self.last_finished = finished
        if device_s is None:
            return behind
        return min(finished - started, max(behind, device_s))
