"""One decoder layer's projections in FP8 against bf16, with the passes that quantize. GPU.

For each projection of the Qwen3-1.7B and Qwen2.5-0.5B shapes (q/k/v, output, gate/up, down)
at decode and prefill row counts this times, as device time per call from CUDA-graph
replays (weights rotating through 8 copies so they come from HBM):

- bf16: ``F.linear`` (cuBLAS);
- fp8 per row: ``torch._scaled_mm`` with a scale per activation row and per output
  channel (what quantization "fp8" runs);
- fp8 per tensor: ``torch._scaled_mm`` with one scale each (quantization "fp8-tensorwise");
- fp8 per tensor, fast accumulation: the same with ``use_fast_accum`` (Hopper's FP8 tensor
  cores accumulate in reduced precision between promotions);

and the quantizing passes that write each projection's input (RMSNorm for q/k/v and gate/up,
the gated activation for down, a quantize pass for the output projection) per row and per
tensor (two launches), against their bf16 passes.

    python benchmarks/fp8_gemm.py --output benchmarks/results/fp8-gemm.json
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

# (K, N) of each projection in the engine's fused layout: q/k/v, o, gate/up, down.
SHAPES = {
    "qwen3-1.7b": {"qkv": (2048, 4096), "o": (2048, 2048), "gate_up": (2048, 12288),
                   "down": (6144, 2048)},
    "qwen2.5-0.5b": {"qkv": (896, 1152), "o": (896, 896), "gate_up": (896, 9728),
                     "down": (4864, 896)},
}  # fmt: skip
ROWS = (256, 1256, 5256)  # a decode level of beam 256; prefills of L = 1000 and 5000
WEIGHT_COPIES = 8
FP8 = torch.float8_e4m3fn


def gemm_times(rows: int, k: int, n: int) -> dict:
    """Device ms per (rows, k) x (k, n) GEMM, the four ways of the module doc."""
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(WEIGHT_COPIES)]
    x8 = x.to(FP8)
    w8 = [w.to(FP8) for w in weights]
    row_a = torch.rand(rows, 1, device="cuda") + 0.5
    row_b = torch.rand(1, n, device="cuda") + 0.5
    one = torch.ones((), device="cuda")
    turn = [0]

    def nxt() -> int:
        turn[0] = (turn[0] + 1) % WEIGHT_COPIES
        return turn[0]

    def scaled(scale_a, scale_b, fast=False):
        return lambda: torch._scaled_mm(
            x8, w8[nxt()].t(), scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )  # fmt: skip

    ways = {
        "bf16": lambda: F.linear(x, weights[nxt()]),
        "fp8_rowwise": scaled(row_a, row_b),
        "fp8_tensorwise": scaled(one, one),
        "fp8_tensorwise_fast_accum": scaled(one, one, fast=True),
    }
    return {f"{name}_ms": graph_ms(fn, calls=16, replays=10) for name, fn in ways.items()}


def pass_times(rows: int, hidden: int, inter: int) -> dict:
    """Device ms of the passes writing each projection's input: bf16, FP8 per row and per
    tensor (RMSNorm with the residual add, gated activation, quantize)."""
    from xgr.kernels.triton_elementwise import gated_mul_interleaved, rms_norm
    from xgr.kernels.triton_fp8 import gated_mul_fp8, quantize_rows, rms_norm_fp8

    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    times = {
        "rms_norm_bf16_ms": graph_ms(lambda: rms_norm(x, weight, 1e-6, residual)),
        "gated_bf16_ms": graph_ms(lambda: gated_mul_interleaved(gate_up)),
    }
    for label, per_tensor in (("rowwise", False), ("tensorwise", True)):
        times[f"rms_norm_fp8_{label}_ms"] = graph_ms(
            lambda p=per_tensor: rms_norm_fp8(x, weight, 1e-6, residual, p)
        )
        times[f"gated_fp8_{label}_ms"] = graph_ms(
            lambda p=per_tensor: gated_mul_fp8(gate_up, "silu", p)
        )
        times[f"quantize_{label}_ms"] = graph_ms(lambda p=per_tensor: quantize_rows(x, p))
    return times


def main() -> None:
    args = gpu_benchmark_args(__doc__.splitlines()[0])
    gemms, passes = [], []
    ways = ("bf16", "fp8_rowwise", "fp8_tensorwise", "fp8_tensorwise_fast_accum")
    print(
        f"{'model':<14}{'rows':>6}{'proj':>9}" + "".join(f"{w[:18]:>20}" for w in ways) + "  (us)"
    )
    for model, shapes in SHAPES.items():
        for rows in ROWS:
            total = dict.fromkeys(ways, 0.0)
            for proj, (k, n) in shapes.items():
                times = gemm_times(rows, k, n)
                gemms.append({"model": model, "rows": rows, "projection": proj, "k": k, "n": n,
                              **times})  # fmt: skip
                for w in ways:
                    total[w] += times[f"{w}_ms"]
                cells = "".join(f"{times[f'{w}_ms'] * 1e3:>20.1f}" for w in ways)
                print(f"{model:<14}{rows:>6}{proj:>9}{cells}", flush=True)
            ratios = "".join(f"{total['bf16'] / total[w]:>20.2f}" for w in ways)
            print(f"{model:<14}{rows:>6}{'x bf16':>9}{ratios}", flush=True)
            hidden, inter = shapes["o"][0], shapes["down"][0]
            p = {"model": model, "rows": rows, **pass_times(rows, hidden, inter)}
            passes.append(p)
            print("    passes (us): " + ", ".join(
                f"{key.removesuffix('_ms')} {v * 1e3:.1f}" for key, v in p.items()
                if key.endswith("_ms")
            ), flush=True)  # fmt: skip
    report = {
        "benchmark": "decoder-layer projections: bf16 vs FP8 (row-wise, per-tensor, fast "
        "accumulation) GEMMs and the FP8-writing passes",
        **run_environment(),
        "gemms": gemms,
        "passes": passes,
    }
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
