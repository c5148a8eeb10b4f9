"""The batches an engine runs at once (``Lanes``): each lane a CUDA stream with its own CUDA
graphs, the batches in flight on them, and the gate that lets a capturing lane run alone."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.streams import CaptureGate, exclusive_stream
from xgr.runner import ModelRunner

logger = logging.getLogger(__name__)

# How often a launch waiting for a lane checks whether a launched batch has finished (s).
LANE_POLL_SECONDS = 0.01

T = TypeVar("T")


@dataclass(frozen=True)
class Lane:
    """One stream's share of the engine.

    Attributes:
        index: the lane's number, from 0.
        stream: the CUDA stream its batches queue on; None on the CPU.
        graphs: the CUDA graphs its batches replay (with their own buffers and prompt-KV
            pool; the weights are shared); None where batches run eagerly.
    """

    index: int
    stream: torch.cuda.Stream | None
    graphs: CudaGraphs | None


class LaneHold:
    """A lane taken by one launched batch (``Lanes.take``), until ``release``."""

    def __init__(self, lanes: Lanes, lane: Lane) -> None:
        self.lane = lane
        self._lanes = lanes
        self._device_done: Callable[[], bool] | None = None
        self._released = False

    def watch(self, device_done: Callable[[], bool]) -> None:
        """Let a launch waiting for a lane take this one back once ``device_done()`` is
        true, even if nobody has collected the batch."""
        self._device_done = device_done
        self._lanes._track(self)

    def device_done(self) -> bool:
        return self._device_done is not None and self._device_done()

    def release(self) -> None:
        """Give the lane back (once; later calls do nothing)."""
        self._lanes._give_back(self)


class Lanes:
    """The engine's lanes: streams x batches queued per stream.

    One stream is the one current at construction, fixed, so that its batches queue in
    order whichever thread launches them; several are streams of their own
    (``exclusive_stream``). A lane is taken for a batch from its launch until its results
    reach the host; each stream is ``depth`` lanes (its batches queue behind each other on
    the device, so the host prepares the next batch while the device computes one).

    Args:
        runner: the model's runner (each lane's ``CudaGraphs`` runs it).
        device: the model's device.
        streams: CUDA streams (1 on the CPU, where the value is ignored with a warning).
        depth: batches queued per stream before the first is collected (1 on the CPU).
        cuda_graphs: on CUDA, give every lane CUDA graphs; False runs eagerly.
    """

    def __init__(
        self,
        runner: ModelRunner,
        device: torch.device,
        streams: int = 1,
        depth: int = 2,
        cuda_graphs: bool = True,
    ) -> None:
        cuda = device.type == "cuda"
        if streams > 1 and not cuda:
            logger.warning("cuda_streams=%d ignored on the CPU: one batch at a time", streams)
        count = streams if cuda else 1
        if count > 1:
            handles = [exclusive_stream(self, device, "lane") for _ in range(count)]
        else:
            handles = [torch.cuda.current_stream(device) if cuda else None]
        self.lanes = tuple(
            Lane(i, stream, CudaGraphs(runner) if cuda_graphs and cuda else None)
            for i, stream in enumerate(handles)
        )
        self.depth = depth if cuda else 1
        self._gate = CaptureGate()
        self._free: queue.SimpleQueue[Lane] = queue.SimpleQueue()
        for _ in range(self.depth):
            for lane in self.lanes:
                self._free.put(lane)
        self._lock = threading.Lock()
        self._in_flight: dict[int, LaneHold] = {}  # launched, lane still held

    @property
    def capacity(self) -> int:
        """Batches that can be in flight at once: streams x depth."""
        return len(self.lanes) * self.depth

    def take(self) -> LaneHold:
        """A free lane; while there is none, batches whose device work has finished give
        theirs back even if nobody has collected them (a caller that launches more batches
        than ``capacity`` without collecting waits for the device, not forever)."""
        while True:
            try:
                return LaneHold(self, self._free.get(timeout=LANE_POLL_SECONDS))
            except queue.Empty:
                with self._lock:
                    held = list(self._in_flight.values())
                for hold in held:
                    if hold.device_done():
                        hold.release()

    def run(self, lane: Lane, launch: Callable[[], T], needs_capture: Callable[[], bool]) -> T:
        """Run ``launch`` on the lane's stream: alone (``CaptureGate.exclusive``) if it
        captures a graph, else beside other launches. With several lanes, whether it
        captures is checked again under the graphs' lock once the shared gate is held:
        another batch of the same lane may have dropped graphs (a pool growth) since."""
        graphs = lane.graphs
        concurrent = graphs is not None and self.capacity > 1
        alone = concurrent and needs_capture()
        stream = lane.stream
        while True:
            with (
                self._gate.exclusive() if alone else self._gate.shared(),
                torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(),
                graphs.lock if concurrent else contextlib.nullcontext(),
            ):
                if alone or not concurrent or not needs_capture():
                    return launch()
            alone = True

    def _track(self, hold: LaneHold) -> None:
        with self._lock:
            if not hold._released:
                self._in_flight[id(hold)] = hold

    def _give_back(self, hold: LaneHold) -> None:
        with self._lock:
            if hold._released:
                return
            hold._released = True
            self._in_flight.pop(id(hold), None)
        self._free.put(hold.lane)
