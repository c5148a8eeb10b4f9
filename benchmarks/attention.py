"""Decode attention per layer and step: xgr's Triton kernel vs per-beam SDPA, on the GPU.

For each shape (Qwen3-1.7B: 16 query / 8 KV heads, head_dim 128; Qwen2.5-0.5B: 14 / 2 / 64),
prompt length L, beam width B and request count R, it times one layer's decode attention at
the last step of a 3-level search (2 beam tokens): xgr fused and staged, and PyTorch SDPA over
per-beam expanded KV (what per-beam engines store and read). It also times the two ways of
keeping beams' own KV after selection (in-place reorder copy vs following the ancestry
index) and measures the GPU's copy bandwidth and bf16 matrix rate in the same run.

    python benchmarks/attention.py --output benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from xgr.kernels.decode_attention import decode_attention_reference  # noqa: E402
from xgr.kernels.triton_decode_attention import beam_decode_attention  # noqa: E402

SHAPES = {"qwen3-1.7b": (16, 8, 128), "qwen2.5-0.5b": (14, 2, 64)}
PROMPT_LENGTHS = (1000, 3000, 5000)
BEAM_WIDTHS = (128, 256, 512)
REQUESTS = (1, 8)
BEAM_TOKENS = 2
DTYPE = torch.bfloat16
# Per-beam SDPA materializes R * B copies of the prompt KV; skip it above this many bytes.
SDPA_MAX_BYTES = 48 * 2**30
# Each timed call reads a different copy of the prompt KV until this many bytes are in play, so
# the timings come from HBM as in a real model (one KV per layer), not from the 60 MB L2.
ROTATION_BYTES = 512 * 2**20


def bench(fn, warmup: int, rep: int) -> float:
    """Median milliseconds of ``fn`` (CUDA events, after warm-up)."""
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per s) and bf16 matmul FLOP/s."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench(lambda: dst.copy_(src), warmup=10, rep=100)
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = bench(lambda: a @ b, warmup=10, rep=100)
    return {
        "copy_bandwidth_bytes_per_s": 2 * src.numel() / (copy_ms * 1e-3),
        "bf16_matmul_flop_per_s": 2 * 8192**3 / (mm_ms * 1e-3),
    }


def inputs(num_heads, num_kv_heads, head_dim, length, beam_width, requests):
    rows = requests * beam_width
    q = torch.randn(rows, num_heads, head_dim, device="cuda", dtype=DTYPE)
    k = torch.randn(requests * length, num_kv_heads, head_dim, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    bk = torch.randn(rows, BEAM_TOKENS + 1, num_kv_heads, head_dim, device="cuda", dtype=DTYPE)
    bv = torch.randn_like(bk)
    cu = torch.arange(requests + 1, device="cuda") * length
    return q, k, v, cu, bk, bv


def run_config(shape_name, length, beam_width, requests, ceilings) -> dict:
    num_heads, num_kv_heads, head_dim = SHAPES[shape_name]
    q, k, v, cu, bk, bv = inputs(num_heads, num_kv_heads, head_dim, length, beam_width, requests)
    rows = q.shape[0]
    scale = head_dim**-0.5
    identity = torch.arange(rows, device="cuda", dtype=torch.int32)[:, None].repeat(1, 3)
    ancestry = torch.randint(0, rows, (rows, 3), device="cuda", dtype=torch.int32)

    copies = max(1, min(16, ROTATION_BYTES // (2 * k.numel() * k.element_size())))
    kv_sets = itertools.cycle([(k, v)] + [(k.clone(), v.clone()) for _ in range(copies - 1)])

    def fused(beam_rows=identity, rotate=True):
        kk, vv = next(kv_sets) if rotate else (k, v)
        return beam_decode_attention(
            q, kk, vv, cu, bk, bv, beam_rows, BEAM_TOKENS, beam_width, scale
        )

    def staged(rotate=True):
        kk, vv = next(kv_sets) if rotate else (k, v)
        return beam_decode_attention(
            q, kk, vv, cu, bk, bv, identity, BEAM_TOKENS, beam_width, scale, staged=True
        )

    # Correctness against the torch reference on this very input.
    ref = decode_attention_reference(
        q, k, v, cu.tolist(), bk[:, :BEAM_TOKENS], bv[:, :BEAM_TOKENS], beam_width, scale
    ).float()
    err = ((fused(rotate=False).float() - ref).abs().max() / ref.abs().max()).item()
    err_staged = ((staged(rotate=False).float() - ref).abs().max() / ref.abs().max()).item()
    fused_ms = bench(fused, warmup=10, rep=50)
    staged_ms = bench(staged, warmup=10, rep=50)
    ancestry_ms = bench(lambda: fused(ancestry), warmup=10, rep=50)
    parents = torch.randint(0, rows, (rows,), device="cuda")

    def reorder():  # what BeamKV.reorder does per layer: copy the written slots by parent
        for cache in (bk, bv):
            written = cache[:, :BEAM_TOKENS]
            written.copy_(written.index_select(0, parents))

    reorder_ms = bench(reorder, warmup=10, rep=50)

    itemsize = q.element_size()
    shared_bytes = 2 * requests * length * num_kv_heads * head_dim * itemsize
    moved = shared_bytes + 2 * rows * BEAM_TOKENS * num_kv_heads * head_dim * itemsize
    moved += 2 * q.numel() * itemsize  # q in, out
    flops = 4 * rows * num_heads * (length + BEAM_TOKENS) * head_dim
    floor_ms = 1e3 * max(
        moved / ceilings["copy_bandwidth_bytes_per_s"], flops / ceilings["bf16_matmul_flop_per_s"]
    )
    best_ms = min(fused_ms, staged_ms)
    result = {
        "shape": shape_name,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "prompt_len": length,
        "beam_width": beam_width,
        "requests": requests,
        "fused_ms": fused_ms,
        "staged_ms": staged_ms,
        "fused_ancestry_rows_ms": ancestry_ms,
        "reorder_copy_ms": reorder_ms,
        "bytes_moved": moved,
        "flops": flops,
        "shared_kv_bytes": shared_bytes,
        "roofline_ms": floor_ms,
        "roofline_fraction": floor_ms / best_ms,
        "bound": "compute"
        if flops / ceilings["bf16_matmul_flop_per_s"]
        > moved / ceilings["copy_bandwidth_bytes_per_s"]
        else "memory",
        "max_rel_err_fused": err,
        "max_rel_err_staged": err_staged,
    }
    sdpa_bytes = 2 * rows * (length + BEAM_TOKENS) * num_kv_heads * head_dim * itemsize
    if sdpa_bytes <= SDPA_MAX_BYTES:
        # Per-beam engines store one copy of the prompt KV per beam: [rows, Hkv, L + t, D].
        kk = torch.cat(
            [
                k.view(requests, 1, length, num_kv_heads, head_dim)
                .expand(requests, beam_width, length, num_kv_heads, head_dim)
                .reshape(rows, length, num_kv_heads, head_dim),
                bk[:, :BEAM_TOKENS],
            ],
            1,
        )
        kk = kk.transpose(1, 2).contiguous()
        vv = kk.clone()
        qq = q[:, :, None, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa_ms = bench(lambda: sdpa(qq, kk, vv, scale=scale, enable_gqa=True), warmup=5, rep=30)
        result.update(sdpa_ms=sdpa_ms, speedup_vs_sdpa=sdpa_ms / best_ms, sdpa_kv_bytes=sdpa_bytes)
        del kk, vv
    else:
        result.update(sdpa_ms=None, speedup_vs_sdpa=None, sdpa_kv_bytes=sdpa_bytes)
    torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="one configuration only")
    args = parser.parse_args()
    ceilings = measure_ceilings()
    configs = [
        (s, L, B, R) for s in SHAPES for L in PROMPT_LENGTHS for B in BEAM_WIDTHS for R in REQUESTS
    ]
    if args.quick:
        configs = [("qwen3-1.7b", 3000, 512, 1)]
    results, lines = [], []
    header = (
        f"{'shape':<13}{'L':>6}{'B':>5}{'R':>3}{'fused us':>10}{'staged us':>10}"
        f"{'sdpa us':>10}{'x sdpa':>8}{'roofline':>9}{'bound':>8}{'reorder us':>11}"
        f"{'ancestry us':>12}{'err':>9}"
    )
    print(header, flush=True)
    for config in configs:
        r = run_config(*config, ceilings)
        results.append(r)
        sdpa = f"{r['sdpa_ms'] * 1e3:10.1f}" if r["sdpa_ms"] else f"{'skipped':>10}"
        speed = f"{r['speedup_vs_sdpa']:8.1f}" if r["speedup_vs_sdpa"] else f"{'-':>8}"
        lines.append(
            f"{r['shape']:<13}{r['prompt_len']:>6}{r['beam_width']:>5}{r['requests']:>3}"
            f"{r['fused_ms'] * 1e3:10.1f}{r['staged_ms'] * 1e3:10.1f}{sdpa}{speed}"
            f"{r['roofline_fraction']:9.2f}{r['bound']:>8}{r['reorder_copy_ms'] * 1e3:11.1f}"
            f"{r['fused_ancestry_rows_ms'] * 1e3:12.1f}{r['max_rel_err_fused']:9.1e}"
        )
        print(lines[-1], flush=True)
    copy_tb = ceilings["copy_bandwidth_bytes_per_s"] / 1e12
    matmul_tf = ceilings["bf16_matmul_flop_per_s"] / 1e12
    print(f"\nceilings: copy {copy_tb:.2f} TB/s, bf16 matmul {matmul_tf:.0f} TFLOP/s")
    print("\n".join([header, *lines]))
    report = {
        "benchmark": "decode attention per layer per step (last step of 3, 2 beam tokens)",
        "date": datetime.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": str(DTYPE),
        "ceilings": ceilings,
        "results": results,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
