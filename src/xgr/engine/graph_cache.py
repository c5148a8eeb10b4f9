"""Captured CUDA graphs by key: captured on first use, replayed after, least recently used
dropped beyond a limit; the mechanics under ``xgr.engine.cuda_graph.CudaGraphs``."""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from xgr.engine.streams import exclusive_stream

logger = logging.getLogger(__name__)


@dataclass
class CapturedGraph:
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor, ...]  # static inputs: staging views, or copied into
    outputs: Any  # what the captured work returned: static outputs, valid until the next replay


class GraphCache:
    """Graphs by key, all allocating from one memory pool.

    The pool is shared safely only while replays never overlap and each replay's outputs
    are consumed before the next (``CudaGraphs`` ensures both).

    Args:
        max_graphs: graphs kept; the least recently used is dropped beyond this.
    """

    def __init__(self, max_graphs: int) -> None:
        self.max_graphs = max_graphs
        self.captures = 0  # graphs captured so far (for tests and logs)
        self.capture_stream: torch.cuda.Stream | None = None
        self._graphs: OrderedDict[Hashable, CapturedGraph] = OrderedDict()
        self._mempool = None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def keys(self) -> list[Hashable]:
        """The keys held, least recently used first."""
        return list(self._graphs)

    def clear(self) -> None:
        """Drop every graph (they held addresses that are about to change)."""
        self._graphs.clear()
        # With its last graph gone the memory pool is released, and PyTorch refuses a new
        # capture into a released pool (an internal assert): take a fresh one.
        self._mempool = None

    def drop(self, keys: Sequence[Hashable]) -> None:
        """Drop these keys' graphs (the device done with them)."""
        for key in keys:
            self._graphs.pop(key, None)
        if not self._graphs:
            self._mempool = None  # as ``clear``: a released pool takes no new capture

    def replay(
        self,
        key: Hashable,
        build: Callable[[], tuple[Sequence[torch.Tensor], Callable]],
        fill: Callable[[Sequence[torch.Tensor]], None] | None = None,
    ) -> CapturedGraph:
        """Replay ``key``'s graph, capturing it first when absent.

        Args:
            build: () -> (static input tensors, ``run``): the buffers a new graph reads and
                the work it captures (``run()`` returns the outputs: tensors, or an object
                holding them).
            fill: copies this batch into the static inputs, before capture or replay; None
                where the batch is already there (staged).
        """
        entry = self._graphs.get(key)
        if entry is None:
            static, run = build()
            if fill is not None:
                fill(static)
            entry = self.capture(key, run, tuple(static))
        else:
            self._graphs.move_to_end(key)
            if fill is not None:
                fill(entry.inputs)
        entry.graph.replay()
        return entry

    def capture(self, key: Hashable, run: Callable, inputs: tuple) -> CapturedGraph:
        """Capture ``run`` as ``key``'s graph after one warm-up run (it compiles kernels and
        creates library handles), both on a side stream; the graph is not replayed."""
        if self.capture_stream is None:
            # Drawn for this cache (no reference back to its holder, which would make a
            # cycle that only the cyclic collector frees, GPU memory and stream with it):
            # handed back when the cache is freed.
            self.capture_stream = exclusive_stream(self, inputs[0].device, "capture")
        stream = self.capture_stream
        started = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run()
        torch.cuda.current_stream().wait_stream(stream)
        warmed = time.perf_counter()
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(
            graph,
            pool=self._mempool,
            stream=stream,
            # thread_local: another lane's thread may launch or allocate during this capture.
            capture_error_mode="thread_local",
        ):
            outputs = run()
        done = time.perf_counter()
        entry = self.add(key, graph, inputs, outputs)
        logger.info(
            "captured CUDA graph %s in %.1f ms (warm-up run %.1f ms)",
            key, (done - started) * 1e3, (warmed - started) * 1e3,
        )  # fmt: skip
        return entry

    def add(self, key: Hashable, graph, inputs: tuple, outputs: Any) -> CapturedGraph:
        """Keep a captured graph (``graph.replay()`` reruns its work) under ``key``."""
        self.captures += 1
        entry = CapturedGraph(graph, inputs, outputs)
        self._graphs[key] = entry
        # The capture synchronized the device: no launched batch still replays the graph
        # dropped here.
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
