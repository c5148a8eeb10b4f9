"""The pending batch's wait (``PendingGeneration``)."""

from __future__ import annotations

import threading
import time

import torch

from xgr.engine import generate
from xgr.engine.generate import PendingGeneration


class _FakeEvent:
    """Stands in for a CUDA event: synchronize takes a while, so two waiters overlap."""

    def __init__(self) -> None:
        self.finished = False

    def synchronize(self) -> None:
        time.sleep(0.05)
        self.finished = True

    def query(self) -> bool:
        return self.finished

    def elapsed_time(self, other) -> float:
        return 1.5


def test_waiting_from_two_threads_returns_the_events_to_the_pool_once(monkeypatch):
    pool = generate._TimingEvents()
    monkeypatch.setattr(generate, "_TIMING_EVENTS", pool)
    events = [_FakeEvent() for _ in range(4)]
    zeros = torch.zeros(1, 2)
    pending = PendingGeneration(zeros, zeros, zeros[..., None], events, device_index=0)
    assert not pending.done()
    outputs = []
    threads = [threading.Thread(target=lambda: outputs.append(pending.wait())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert outputs[0] is outputs[1] and outputs[0].prefill_ms == 1.5
    assert pending.done()
    assert pool._free[0] == [events]  # handed back once: no two batches share a set
    assert pool.take(0) is events and not pool._free[0]
