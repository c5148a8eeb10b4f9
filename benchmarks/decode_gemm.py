"""Decode-shape GEMMs on the GPU: cuBLAS's choice against cuBLASLt's and a transposed weight.

A decode step multiplies the beams' hidden states (M = beams x requests rows) by each
projection's weight. At M = 256-512 rows the grid of output tiles is small next to a large GPU's
SMs (132 on an H200), so these GEMMs run below the matrix rate. This times each projection shape
of the Qwen3-1.7B and T5 OneRec-like models (and M = 1000, a prefill) four ways: ``F.linear`` on
the (N, K) weight as the engine stores it and ``x @ w_t`` on a (K, N) copy, each with PyTorch's
cuBLAS and cuBLASLt back ends (``torch.backends.cuda.preferred_blas_library``). Times are device
time per GEMM from CUDA-graph replays, weights rotating through 8 copies so they come from HBM.

    python benchmarks/decode_gemm.py --output benchmarks/results/decode-gemm.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import gpu_benchmark_args, graph_ms, run_environment  # noqa: E402

# (K, N) of each projection: Qwen3-1.7B q/k/v, o, gate/up, down; T5 OneRec-like (d_model
# 1024, d_ff 4096, gated) q/k/v, o, wi_0/wi_1, wo.
SHAPES = {
    "qwen3-1.7b": [(2048, 4096), (2048, 2048), (2048, 12288), (6144, 2048)],
    "t5-onerec-like": [(1024, 3072), (1024, 1024), (1024, 8192), (4096, 1024)],
}
ROWS = (256, 512, 1000)
WEIGHT_COPIES = 8


def time_shape(rows: int, k: int, n: int) -> dict:
    """Device ms per GEMM of (rows, k) x (k, n), bf16, the four ways of the module doc."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_COPIES)]
    transposed = [w.t().contiguous() for w in weights]
    turn = [0]

    def linear():
        turn[0] = (turn[0] + 1) % WEIGHT_COPIES
        return F.linear(x, weights[turn[0]])

    def matmul_transposed():
        turn[0] = (turn[0] + 1) % WEIGHT_COPIES
        return x @ transposed[turn[0]]

    times = {}
    try:
        for library in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(library)
            times[f"linear_{library}_ms"] = graph_ms(linear, calls=16, replays=10)
            times[f"matmul_transposed_{library}_ms"] = graph_ms(
                matmul_transposed, calls=16, replays=10
            )
    finally:
        torch.backends.cuda.preferred_blas_library("cublas")
    best = min(times.values())
    return {
        "rows": rows,
        "k": k,
        "n": n,
        **times,
        "best_tflop_per_s": 2 * rows * k * n / best / 1e9,
    }


def main() -> None:
    args = gpu_benchmark_args(__doc__.splitlines()[0])
    results = []
    print(f"{'model':<16}{'M':>6}{'K':>6}{'N':>7}  linear / x @ w_t, cuBLAS then cuBLASLt (us)")
    for rows in ROWS:
        for model, shapes in SHAPES.items():
            for k, n in shapes:
                r = {"model": model, **time_shape(rows, k, n)}
                results.append(r)
                cells = "".join(f"{v * 1e3:8.1f}" for key, v in r.items() if key.endswith("_ms"))
                print(
                    f"{model:<16}{rows:>6}{k:>6}{n:>7}{cells}  {r['best_tflop_per_s']:5.0f} TFLOP/s"
                )
    report = {
        "benchmark": "decode-shape GEMMs: cuBLAS vs cuBLASLt, (N, K) vs (K, N) weight",
        **run_environment(),
        "dtype": "bfloat16",
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
