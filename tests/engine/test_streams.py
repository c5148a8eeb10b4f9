"""The engine's CUDA streams: the capture gate and streams held by one owner each (stand-in
streams on the CPU; the GPU tests replay real graphs on them)."""

from __future__ import annotations

import gc
import threading
import time
import types

import pytest
import torch

from xgr import XgrError
from xgr.engine import streams as streams_module
from xgr.engine.streams import CaptureGate, _ExclusiveStreams


def test_capture_gate_runs_a_capture_alone():
    gate, events = CaptureGate(), []
    release_first = threading.Event()

    def run(kind, name, hold=None):
        with gate.exclusive() if kind == "capture" else gate.shared():
            events.append(f"{name} in")
            if hold is not None:
                hold.wait(5)
            else:
                time.sleep(0.05)
            events.append(f"{name} out")

    first = threading.Thread(target=run, args=("batch", "a", release_first))
    first.start()
    while "a in" not in events:
        time.sleep(0.001)
    capture = threading.Thread(target=run, args=("capture", "c"))
    capture.start()
    time.sleep(0.05)
    later = threading.Thread(target=run, args=("batch", "b"))  # arrives while c waits
    later.start()
    time.sleep(0.05)
    assert events == ["a in"]  # c waits for a; b waits behind the pending capture
    release_first.set()
    for t in (first, capture, later):
        t.join(5)
    assert events == ["a in", "a out", "c in", "c out", "b in", "b out"]


class _PooledStreams:
    """Stand-ins for ``torch.cuda.Stream``: new objects over CUDA handles handed out in turn
    from a pool of ``size``, as PyTorch does."""

    def __init__(self, size):
        self.size, self.turns, self.synced = size, {}, []

    @property
    def drawn(self):
        return sum(self.turns.values())

    def stream(self, device):
        self.turns[device] = self.turns.get(device, 0) + 1
        return types.SimpleNamespace(cuda_stream=1000 * device + self.turns[device] % self.size)

    def synchronize(self, device=None):
        self.synced.append(device)


class _Owner:
    pass


def _stand_in_streams(monkeypatch, size: int) -> _PooledStreams:
    """torch.cuda's Stream and synchronize replaced by a pool of ``size`` stand-ins."""
    pool = _PooledStreams(size)
    monkeypatch.setattr(torch.cuda, "Stream", pool.stream)
    monkeypatch.setattr(torch.cuda, "synchronize", pool.synchronize)
    monkeypatch.setattr(streams_module, "STREAM_POOL_SIZE", size)
    return pool


def test_exclusive_streams_are_held_one_owner_at_a_time_and_reused(monkeypatch):
    """A stream keeps its cuBLAS workspace for the process's life: a live owner has one to
    itself, and a collected owner's stream (with its workspace) goes to the next."""
    pool = _stand_in_streams(monkeypatch, size=32)
    streams = _ExclusiveStreams()
    a, b = _Owner(), _Owner()
    first = streams.take(a, torch.device("cuda", 0), "capture")
    second = streams.take(b, torch.device("cuda", 0), "capture")
    other_device = streams.take(_Owner(), torch.device("cuda", 1), "capture")  # collected at once
    assert first.cuda_stream != second.cuda_stream and not pool.synced
    del a
    gc.collect()
    assert streams.take(_Owner(), torch.device("cuda", 1), "capture") is other_device
    c = _Owner()
    assert streams.take(c, torch.device("cuda", 0), "capture") is first
    assert pool.synced == [1, 0]  # a collected owner's work may still use the workspace
    assert streams.take(_Owner(), torch.device("cuda", 0), "capture") is not second  # b is alive
    assert pool.drawn == 4


def test_exclusive_streams_skip_cuda_streams_that_live_owners_hold(monkeypatch):
    _stand_in_streams(monkeypatch, size=3)  # PyTorch wraps after 32 draws; here 3
    streams = _ExclusiveStreams()
    owners = [_Owner() for _ in range(3)]
    handles = [streams.take(o, torch.device("cuda", 0), "capture").cuda_stream for o in owners[:2]]
    torch.cuda.Stream(device=0)  # someone else draws: the pool moves on
    # The next draw would give the first owner's CUDA stream again: it is drawn past.
    handles.append(streams.take(owners[2], torch.device("cuda", 0), "capture").cuda_stream)
    assert len(set(handles)) == 3
    with pytest.raises(XgrError, match="all 3 of PyTorch's CUDA streams on device 0"):
        streams.take(_Owner(), torch.device("cuda", 0), "capture")
    del owners[1]
    gc.collect()
    assert streams.take(_Owner(), torch.device("cuda", 0), "capture").cuda_stream == handles[1]


def test_given_back_streams_go_to_the_same_use_and_are_not_drawn_twice(monkeypatch):
    _stand_in_streams(monkeypatch, size=4)
    streams = _ExclusiveStreams()
    lane = streams.take(_Owner(), torch.device("cuda", 0), "lane")  # both given back at once
    capture = streams.take(_Owner(), torch.device("cuda", 0), "capture")
    owners = [_Owner() for _ in range(3)]
    taken = [streams.take(o, torch.device("cuda", 0), "capture") for o in owners]
    # The capture stream given back comes first; then draws that pass over the lane stream
    # given back (the pool hands its CUDA stream out again).
    assert taken[0] is capture
    assert lane.cuda_stream not in {s.cuda_stream for s in taken[1:]}
    assert len({s.cuda_stream for s in taken}) == 3
    # The pool is spent: the lane stream given back is used for a capture rather than fail.
    assert streams.take(_Owner(), torch.device("cuda", 0), "capture") is lane


def test_an_owner_that_cannot_be_weakly_referenced_takes_no_stream(monkeypatch):
    pool = _stand_in_streams(monkeypatch, size=4)
    streams = _ExclusiveStreams()
    with pytest.raises(TypeError):
        streams.take(object(), torch.device("cuda", 0), "lane")  # object() has no weakrefs
    assert not streams._held
    reused = streams.take(_Owner(), torch.device("cuda", 0), "lane")
    assert pool.drawn == 1 and pool.synced == [0]  # the stream drawn for it, not a new one
    assert reused.cuda_stream == 1
