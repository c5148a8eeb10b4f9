"""The scheduler's device timeline: predicted ends, launch times and measured run times."""

from __future__ import annotations

import pytest

from xgr.scheduler.timeline import DEFAULT_LAUNCH_SECONDS, LAUNCH_WINDOW, DeviceTimeline


def test_batches_behind_one_that_ends_late_start_that_much_later():
    timeline = DeviceTimeline()
    assert timeline.start_of_next(10.0, running=False) == 10.0
    timeline.launched(1, 10.5)
    assert timeline.start_of_next(10.1, running=True) == 10.5
    timeline.launched(2, 11.0)
    timeline.finished(1, 10.7, running=True)  # 0.2 s late: the one behind it too
    assert timeline.free_at == pytest.approx(11.2)
    timeline.finished(2, 11.1, running=False)  # nothing left: free now
    assert timeline.free_at == 11.1 and timeline.predicted_end == {}


def test_launch_time_is_the_median_of_the_recent_ones():
    timeline = DeviceTimeline()
    assert timeline.launch_seconds() == DEFAULT_LAUNCH_SECONDS
    for seconds in [0.001] * LAUNCH_WINDOW + [0.5]:  # one capture among them
        timeline.record_launch(seconds)
    assert len(timeline.launch_times) == LAUNCH_WINDOW
    assert timeline.launch_seconds() == 0.001
    assert timeline.lead() == pytest.approx(2 * 0.001 + 0.002)


def test_a_batch_queued_behind_another_counts_from_when_that_one_finished():
    timeline = DeviceTimeline()
    assert timeline.run_seconds(0.0, 1.0, None) == 1.0
    # Launched at 0.5 behind the batch that finished at 1.0, done at 1.4: it ran 0.4 s.
    assert timeline.run_seconds(0.5, 1.4, 0.3) == pytest.approx(0.4)
    # Side by side on another stream (finished together): the engine's device time holds.
    assert timeline.run_seconds(0.6, 1.4, 0.7) == pytest.approx(0.7)
