"""Timing shared by the benchmarks: CUDA-graph replays (device time, no launch gaps), and
whole ``Engine.recommend`` calls (wall time)."""

from __future__ import annotations

import argparse
import datetime
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def run_environment(device: str = "cuda") -> dict[str, str]:
    """What every benchmark's JSON records of its run: the date, the GPU's name (``"cpu"``
    off CUDA) and the torch version."""
    return {
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "torch": torch.__version__,
    }


def gpu_benchmark_args(description: str) -> argparse.Namespace:
    """The ``--output`` argument of a GPU-only benchmark; refuses to run without CUDA (its
    timings are CUDA-graph replays)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (it times CUDA-graph replays)")
    return args


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


def time_recommend(recommend, reps: int, device: str) -> tuple[dict, list]:
    """Wall time of ``recommend()`` (an ``Engine.recommend`` call returning its results),
    after two warm-up calls (graph capture, Triton compilation, one warm replay).

    Returns:
        a row of median and P99 wall ms, the median prefill and decode ms of the first
        result (device time on CUDA), peak GPU GiB of the timed calls on CUDA; and the
        last call's results.
    """
    for _ in range(2):
        recommend()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    wall, prefill, decode = [], [], []
    for _ in range(reps):
        start = time.perf_counter()
        results = recommend()
        wall.append((time.perf_counter() - start) * 1e3)
        prefill.append(results[0].prefill_ms)
        decode.append(results[0].decode_ms)
    row = {
        "median_ms": statistics.median(wall),
        "p99_ms": float(np.percentile(wall, 99)),
        "prefill_ms": statistics.median(prefill),
        "decode_ms": statistics.median(decode),
    }
    if device == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row, results
