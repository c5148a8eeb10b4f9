"""GPU timing shared by the benchmarks: CUDA-graph replays (device time, no launch gaps)."""

from __future__ import annotations

import statistics

import torch


def graph_ms(fn, calls: int = 8, replays: int = 25) -> float:
    """Median device milliseconds per call of ``fn``, with no host launch gaps.

    ``calls`` back-to-back calls are captured in one CUDA graph (as the engine runs its
    decode levels) after two warm-up calls on a side stream (compilation, library handles);
    each replay is timed with CUDA events and divided by ``calls``.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    del graph
    return statistics.median(times)
