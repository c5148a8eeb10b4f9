"""CUDA streams of the engine: a gate that lets a capturing lane run alone, and streams held
by one owner each.

Why ownership matters: PyTorch keeps one cuBLAS workspace per (handle, stream) for the
process's life, and a captured GEMM keeps the workspace of the stream it was captured on. Two
lanes whose graphs were captured on one stream share a workspace and race when replayed at
once; a capture on a new stream each time leaks a workspace (``docs/performance.md``).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import weakref

import torch

from xgr.core import XgrError


class CaptureGate:
    """Lets batches on several lanes run at once, but a batch that captures a graph alone.

    A capture in progress breaks when another thread launches work meanwhile ("operation
    failed due to a previous error during capture", and PyTorch's RNG refusing an offset
    increment), so a capturing batch waits for the launches in progress
    to end and holds new ones back (no starvation: they wait while a capture is pending);
    work already queued on the device is waited for by the capture itself, which
    synchronizes the device first.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0
        self._capturing = False
        self._pending = 0

    @contextlib.contextmanager
    def shared(self):
        """Hold while running a batch that captures nothing."""
        with self._cond:
            self._cond.wait_for(lambda: not self._capturing and not self._pending)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        """Hold while running a batch that captures a graph (or grows a KV pool)."""
        with self._cond:
            self._pending += 1
            self._cond.wait_for(lambda: not self._capturing and not self._running)
            self._pending -= 1
            self._capturing = True
        try:
            yield
        finally:
            with self._cond:
                self._capturing = False
                self._cond.notify_all()


# PyTorch hands out its streams in turn from a pool of this many per device and priority.
STREAM_POOL_SIZE = 32


class _ExclusiveStreams:
    """CUDA streams each held by one owner at a time (an engine's lanes, a ``CudaGraphs``'s
    warm-ups and captures), handed to a later owner once theirs is collected.

    PyTorch keys cuBLAS workspaces (tens of MiB each) by (cuBLAS handle, stream) and
    keeps them for the life of the process, and a GEMM captured in a graph keeps the
    workspace of the stream it was captured on. Two streams that are one CUDA stream share a
    workspace, and GEMMs running on both at once race on it; ``torch.cuda.Stream()`` hands
    out the same CUDA stream again after ``STREAM_POOL_SIZE`` draws. So streams are told
    apart by their CUDA handle, a draw that gives one held by a live owner is drawn again,
    and a collected owner's stream (with its workspaces) goes to the next owner. A new
    stream per capture had left a workspace behind each time: 160 MiB for an engine's first
    four graphs, never returned when the engine was dropped.

    Streams the engine did not draw here (the stream current when an engine is made, a
    caller's own) are not tracked. A stream captured on from another thread gets another
    workspace (cuBLAS handles are per thread), which costs memory, not correctness.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Finalizers only put here: a queue.SimpleQueue may be used from a weakref callback
        # that runs while this thread holds the lock, which a lock taken there could not.
        self._released: queue.SimpleQueue = queue.SimpleQueue()
        # Given-back streams by (device, use): a capture stream goes to the next capture,
        # whose GEMMs then find its workspace made.
        self._free: dict[tuple[int, str], list[torch.cuda.Stream]] = {}
        self._held: set[tuple[int, int]] = set()  # (device, CUDA handle) of live owners

    def take(self, owner: object, device: torch.device, use: str) -> torch.cuda.Stream:
        """A stream for ``owner`` alone, given back when ``owner`` is collected; ``use``
        ("lane" or "capture") groups the given-back streams.

        Raises:
            XgrError: every stream of PyTorch's pool on the device is held.
        """
        index = device.index if device.index is not None else torch.cuda.current_device()
        with self._lock:
            self._drain()
            stream = None if self._free.get((index, use)) else self._draw(index)
            reused = stream is None
            if reused:
                stream = self._given_back(index, use)
            try:  # before the sync below, which may raise: the stream then still comes back
                weakref.finalize(owner, self._released.put, (index, use, stream))
            except BaseException:  # an owner without weak references: nothing was handed out
                self._free.setdefault((index, use), []).append(stream)
                raise
            self._held.add((index, stream.cuda_stream))
        if reused:
            # The collected owner's last work may still run, with this stream's workspace.
            torch.cuda.synchronize(index)
        return stream

    def _drain(self) -> None:
        while True:
            try:
                index, use, stream = self._released.get_nowait()
            except queue.Empty:
                return
            self._held.discard((index, stream.cuda_stream))
            self._free.setdefault((index, use), []).append(stream)

    def _draw(self, index: int) -> torch.cuda.Stream | None:
        """A stream of PyTorch's pool that no owner holds and none given back is, or None."""
        taken = {h for i, h in self._held if i == index}
        for (i, _), free in self._free.items():
            if i == index:
                taken.update(s.cuda_stream for s in free)
        # Twice round the pool: another thread drawing meanwhile moves the turn on.
        for _ in range(2 * STREAM_POOL_SIZE):
            stream = torch.cuda.Stream(device=index)
            if stream.cuda_stream not in taken:
                return stream
        return None

    def _given_back(self, index: int, use: str) -> torch.cuda.Stream:
        """A given-back stream: of ``use`` first (its workspaces are made), else of another
        use (no stream is left to draw)."""
        keys = [(index, use), *(key for key in self._free if key[0] == index)]
        for key in keys:
            if self._free.get(key):
                return self._free[key].pop()
        raise XgrError(
            f"all {STREAM_POOL_SIZE} of PyTorch's CUDA streams on device {index} are held by "
            "live engines' lanes and CUDA graphs; drop an engine or use fewer cuda_streams"
        )


_EXCLUSIVE_STREAMS = _ExclusiveStreams()


def exclusive_stream(owner: object, device: torch.device, use: str) -> torch.cuda.Stream:
    """A CUDA stream that no other live owner holds (``_ExclusiveStreams``), given back
    when ``owner`` is collected; ``use`` is "lane" or "capture".

    Raises:
        XgrError: every stream of PyTorch's pool on ``device`` is held.
    """
    return _EXCLUSIVE_STREAMS.take(owner, device, use)
