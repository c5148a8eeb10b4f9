"""The batch packing (``prepare_inputs``) and the pending batch's wait (``PendingGeneration``)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from xgr.engine import generate
from xgr.engine.generate import PendingGeneration, prepare_inputs


@pytest.mark.parametrize("num", [1, 2, 3, 8])
def test_packed_views_match_the_prompts(num):
    rng = np.random.default_rng(num)
    lens = rng.integers(1, 40, num).tolist()
    # Lists and int64 arrays, as the engine passes them.
    prompts = [
        rng.integers(0, 1000, n).tolist() if i % 2 else rng.integers(0, 1000, n)
        for i, n in enumerate(lens)
    ]
    inputs = prepare_inputs(prompts, torch.device("cpu"))
    cu = np.concatenate([[0], np.cumsum(lens)])
    assert inputs.cu_seqlens_host == cu.tolist()
    assert inputs.num_requests == num and inputs.num_tokens == cu[-1]
    assert inputs.max_seqlen == max(lens) and inputs.seqlens == lens
    assert inputs.tokens.tolist() == np.concatenate([np.asarray(p) for p in prompts]).tolist()
    assert inputs.positions.tolist() == [t for n in lens for t in range(n)]
    assert inputs.last_index.tolist() == (cu[1:] - 1).tolist()
    assert inputs.prompt_lens.tolist() == lens
    assert inputs.cu_seqlens.tolist() == cu.tolist()
    assert inputs.cu_seqlens_int32.dtype == torch.int32
    assert inputs.cu_seqlens_int32.tolist() == cu.tolist()


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
    pending = PendingGeneration(torch.zeros(1, 2), torch.zeros(1, 2), events, device_index=0)
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
