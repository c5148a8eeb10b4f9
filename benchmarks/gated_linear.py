"""Gate/up GEMM with silu(gate) * up in its epilogue vs cuBLAS and a pass, on the GPU.

The feed-forward's gate/up projection, then the activation pass that cuBLAS needs.

For each gate/up shape (Qwen3-1.7B: K 2048, I 6144; Qwen2.5-0.5B: K 896, I 4864) and row
count (256: a decode level's beams; 1,280 and more: prefills of ~1,000-5,000 tokens with
their level-1 rows) it times, as device time per call from CUDA-graph replays with the
weight cycling through copies so it comes from HBM:
- ``F.linear`` on the interleaved weight, then ``gated_mul_interleaved`` (what the engine
  runs below ``GATED_LINEAR_MIN_ROWS``), and ``F.linear`` alone;
- ``gated_linear`` (``xgr.kernels.triton_gated_linear``), and whether its output equals the
  first path's bit for bit.

    python benchmarks/gated_linear.py --output benchmarks/results/gated-linear.json
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

from xgr.kernels.triton_elementwise import gated_mul_interleaved  # noqa: E402
from xgr.kernels.triton_gated_linear import gated_linear  # noqa: E402
from xgr.layers.mlp import GATED_LINEAR_MIN_ROWS  # noqa: E402

# (hidden K, intermediate I) of each model's feed-forward.
SHAPES = {"qwen3-1.7b": (2048, 6144), "qwen2.5-0.5b": (896, 4864)}
ROWS = (256, 512, 1280, 3328, 5376)
WEIGHT_COPIES = 4


def time_shape(rows: int, hidden: int, inter: int) -> dict:
    """Device us per call of the three ways of the module doc, bf16, and the agreement."""
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    weights = [
        torch.randn(2 * inter, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5
        for _ in range(WEIGHT_COPIES)
    ]
    turn = [0]

    def weight() -> torch.Tensor:
        turn[0] = (turn[0] + 1) % WEIGHT_COPIES
        return weights[turn[0]]

    ways = {
        "cublas_and_pass": lambda: gated_mul_interleaved(F.linear(x, weight()), "silu"),
        "cublas_alone": lambda: F.linear(x, weight()),
        "fused_epilogue": lambda: gated_linear(x, weight(), "silu"),
    }
    row = {"rows": rows, "hidden": hidden, "intermediate": inter}
    for name, fn in ways.items():
        row[f"{name}_us"] = graph_ms(fn, calls=8, replays=15) * 1e3
    expected = gated_mul_interleaved(F.linear(x, weights[0]), "silu")
    row["bitwise_equal_fraction"] = (gated_linear(x, weights[0]) == expected).float().mean().item()
    row["speedup"] = row["cublas_and_pass_us"] / row["fused_epilogue_us"]
    row["fused_tflop_per_s"] = 2 * rows * hidden * 2 * inter / row["fused_epilogue_us"] / 1e6
    return row


def main() -> None:
    args = gpu_benchmark_args(__doc__.splitlines()[0])
    results = []
    print(f"engine threshold: GATED_LINEAR_MIN_ROWS = {GATED_LINEAR_MIN_ROWS}")
    print(f"{'model':<14}{'M':>6}{'cuBLAS+pass':>13}{'cuBLAS':>9}{'fused':>9}{'ratio':>7}  equal")
    for model, (hidden, inter) in SHAPES.items():
        for rows in ROWS:
            r = {"model": model, **time_shape(rows, hidden, inter)}
            results.append(r)
            print(
                f"{model:<14}{rows:>6}{r['cublas_and_pass_us']:13.1f}{r['cublas_alone_us']:9.1f}"
                f"{r['fused_epilogue_us']:9.1f}{r['speedup']:7.2f}  "
                f"{r['bitwise_equal_fraction']:.4f}",
                flush=True,
            )
    report = {
        "benchmark": "gate/up GEMM + silu(gate) * up: cuBLAS and a pass vs the fused epilogue (us)",
        **run_environment(),
        "dtype": "bfloat16",
        "gated_linear_min_rows": GATED_LINEAR_MIN_ROWS,
        "results": results,
    }
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
