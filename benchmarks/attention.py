"""Decode attention per layer and step: xgr's Triton kernel vs per-beam SDPA, on the GPU.

For each shape (Qwen3-1.7B: 16 query / 8 KV heads, head_dim 128; Qwen2.5-0.5B: 14 / 2 / 64),
prompt length L, beam width B and request count R, it times one layer's decode attention at
the last step of a 3-level search (2 beam tokens): xgr's kernel as the engine runs it (split
count chosen from the grid size), in one fused launch with no split, staged in two launches, and
PyTorch SDPA over per-beam expanded KV (what per-beam engines store and read). It also times
the two ways of keeping the beams' own KV after selection (copying the written slots by
parent vs reading through the ancestry index) and measures the GPU's copy bandwidth and
bf16 matrix rate in the same run. Kernel times are device times per call from CUDA-graph
replays (as the engine's decode runs); the "eager" column is the same call launched from
Python, host launch cost included. ``--sweep`` times tile/split choices on two shapes;
``--profile-launch`` only runs the launches, for Nsight Compute (``gpu_phases.sh ncu``);
``--prefill`` times the packed causal prefill attention (xgr's packed Triton kernel, which
the engine uses for several prompts, against PyTorch's packed flash attention and SDPA per
prompt); ``--encoder`` the T5 encoder attention (xgr's Triton kernel with the position bias
read per offset, against SDPA with the square mask the engine runs today).

    python benchmarks/attention.py --output benchmarks/results/attention.json
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import itertools
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import graph_ms, run_environment  # noqa: E402

from xgr.kernels.decode_attention import decode_attention_reference  # noqa: E402
from xgr.kernels.decode_attention_launch import DEFAULT_LAUNCH  # noqa: E402
from xgr.kernels.prefill_attention import (  # noqa: E402
    prefill_attention,
    prefill_attention_reference,
)
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


def bench_eager(fn, warmup: int = 10, rep: int = 50) -> float:
    """Median milliseconds of ``fn`` launched from Python (CUDA events, after warm-up).

    For a kernel of tens of microseconds this includes the host's launch cost (argument
    checks, Triton's launcher), which the GPU waits for; ``bench`` leaves it out.
    """
    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


bench = graph_ms  # device time per call from CUDA-graph replays


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy bandwidth (bytes read + written per s) and bf16 matmul FLOP/s."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = bench_eager(lambda: dst.copy_(src), rep=100)
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = bench_eager(lambda: a @ b, rep=100)
    return {
        "copy_bandwidth_bytes_per_s": 2 * src.numel() / (copy_ms * 1e-3),
        "bf16_matmul_flop_per_s": 2 * 8192**3 / (mm_ms * 1e-3),
    }


def warm_up_clocks(seconds: float = 2.0) -> None:
    """Keep the GPU busy with matrix products for a while: an idle GPU starts at a few
    hundred MHz, and the first configurations timed would otherwise run at lower clocks."""
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


class Problem:
    """Random inputs of one configuration, with rotating prompt-KV copies."""

    def __init__(self, shape_name: str, length: int, beam_width: int, requests: int) -> None:
        num_heads, num_kv_heads, head_dim = SHAPES[shape_name]
        self.rows = rows = requests * beam_width
        self.length, self.beam_width, self.requests = length, beam_width, requests
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        dev = "cuda"
        self.q = torch.randn(rows, num_heads, head_dim, device=dev, dtype=DTYPE)
        self.k = torch.randn(requests * length, num_kv_heads, head_dim, device=dev, dtype=DTYPE)
        self.v = torch.randn_like(self.k)
        shape = (rows, BEAM_TOKENS + 1, num_kv_heads, head_dim)
        self.bk = torch.randn(shape, device=dev, dtype=DTYPE)
        self.bv = torch.randn_like(self.bk)
        self.cu = torch.arange(requests + 1, device=dev) * length
        self.scale = head_dim**-0.5
        self.identity = torch.arange(rows, device=dev, dtype=torch.int32)[:, None].repeat(1, 3)
        self.ancestry = torch.randint(0, rows, (rows, 3), device=dev, dtype=torch.int32)
        copies = max(1, min(16, ROTATION_BYTES // (2 * self.k.nbytes)))
        extra = [(self.k.clone(), self.v.clone()) for _ in range(copies - 1)]
        self.kv_sets = itertools.cycle([(self.k, self.v), *extra])

    def run(self, rows=None, rotate=True, staged=False, config=DEFAULT_LAUNCH) -> torch.Tensor:
        k, v = next(self.kv_sets) if rotate else (self.k, self.v)
        rows = self.identity if rows is None else rows
        return beam_decode_attention(
            self.q,
            k,
            v,
            self.cu,
            self.bk,
            self.bv,
            rows,
            BEAM_TOKENS,
            self.beam_width,
            self.scale,
            staged=staged,
            config=config,
        )

    def reference(self) -> torch.Tensor:
        return decode_attention_reference(
            self.q,
            self.k,
            self.v,
            self.cu.tolist(),
            self.bk[:, :BEAM_TOKENS],
            self.bv[:, :BEAM_TOKENS],
            self.beam_width,
            self.scale,
        ).float()


def run_config(shape_name, length, beam_width, requests, ceilings) -> dict:
    p = Problem(shape_name, length, beam_width, requests)
    one_split = dataclasses.replace(DEFAULT_LAUNCH, num_splits=1)
    variants = {
        "xgr": dict(),  # the engine's default launch (split count from the grid size)
        "one_split": dict(config=one_split),  # always one fused launch
        "staged_one_split": dict(staged=True, config=one_split),
    }
    ref = p.reference()
    errors = [
        ((p.run(rotate=False, **kw).float() - ref).abs().max() / ref.abs().max()).item()
        for kw in variants.values()
    ]
    times = {f"{name}_ms": bench(lambda kw=kw: p.run(**kw)) for name, kw in variants.items()}
    times["xgr_ancestry_rows_ms"] = bench(lambda: p.run(rows=p.ancestry))
    times["xgr_eager_ms"] = bench_eager(lambda: p.run())
    parents = torch.randint(0, p.rows, (p.rows,), device="cuda")

    def reorder():  # copying each beam's written slots from its parent, per layer
        for cache in (p.bk, p.bv):
            written = cache[:, :BEAM_TOKENS]
            written.copy_(written.index_select(0, parents))

    times["reorder_copy_ms"] = bench(reorder)
    itemsize = p.q.element_size()
    shared_bytes = 2 * p.k.nbytes
    moved = shared_bytes + 2 * p.rows * BEAM_TOKENS * p.num_kv_heads * p.head_dim * itemsize
    moved += 2 * p.q.nbytes  # q in, out
    flops = 4 * p.rows * p.num_heads * (length + BEAM_TOKENS) * p.head_dim
    memory_ms = 1e3 * moved / ceilings["copy_bandwidth_bytes_per_s"]
    compute_ms = 1e3 * flops / ceilings["bf16_matmul_flop_per_s"]
    result = {
        "shape": shape_name,
        "num_heads": p.num_heads,
        "num_kv_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "prompt_len": length,
        "beam_width": beam_width,
        "requests": requests,
        **times,
        "bytes_moved": moved,
        "flops": flops,
        "shared_kv_bytes": shared_bytes,
        "roofline_ms": max(memory_ms, compute_ms),
        "roofline_fraction": max(memory_ms, compute_ms) / times["xgr_ms"],
        "bound": "compute" if compute_ms > memory_ms else "memory",
        "max_rel_err": max(errors),
    }
    sdpa_bytes = 2 * p.rows * (length + BEAM_TOKENS) * p.num_kv_heads * p.head_dim * itemsize
    result.update(sdpa_ms=None, speedup_vs_sdpa=None, sdpa_kv_bytes=sdpa_bytes)
    if sdpa_bytes <= SDPA_MAX_BYTES:
        # Per-beam engines store one copy of the prompt KV per beam: [rows, Hkv, L + t, D].
        per_beam = (
            p.k.view(requests, 1, length, p.num_kv_heads, p.head_dim)
            .expand(requests, beam_width, length, p.num_kv_heads, p.head_dim)
            .reshape(p.rows, length, p.num_kv_heads, p.head_dim)
        )
        kk = torch.cat([per_beam, p.bk[:, :BEAM_TOKENS]], 1).transpose(1, 2).contiguous()
        vv = kk.clone()
        qq = p.q[:, :, None, :]
        sdpa = torch.nn.functional.scaled_dot_product_attention
        sdpa_ms = bench(lambda: sdpa(qq, kk, vv, scale=p.scale, enable_gqa=True), calls=2)
        result.update(sdpa_ms=sdpa_ms, speedup_vs_sdpa=sdpa_ms / times["xgr_ms"])
        del kk, vv
    return result


def sweep(prompt_lens=(3000,), beam_widths=(512,)) -> tuple[list[dict], dict]:
    """Time launch choices for one request over ``prompt_lens`` x ``beam_widths`` (default
    L=3000, B=512): the default launch (split count from ``choose_num_splits``), with other
    merge tiles and with 1, 2 and 4 splits, each with its fraction of the roofline. The
    best tiles of the earlier sweeps are the default; the variants measured and rejected
    are in docs/performance.md with their result files.
    """
    rows = []
    ceilings = measure_ceilings()
    warm_up_clocks()
    configs = [
        DEFAULT_LAUNCH,
        *(dataclasses.replace(DEFAULT_LAUNCH, merge_block_m=bm) for bm in (8, 32, 64)),
        *(dataclasses.replace(DEFAULT_LAUNCH, num_splits=n) for n in (1, 2, 4)),
        DEFAULT_LAUNCH,  # again: how much the clocks moved
    ]
    for shape, length, beam_width in itertools.product(SHAPES, prompt_lens, beam_widths):
        p = Problem(shape, length, beam_width, 1)
        flops = 4 * p.rows * p.num_heads * (length + BEAM_TOKENS) * p.head_dim
        floor_ms = 1e3 * flops / ceilings["bf16_matmul_flop_per_s"]
        ref = p.reference()
        found = []
        for config in configs:
            try:
                got = p.run(rotate=False, config=config).float()
                ms = bench(lambda c=config, p=p: p.run(config=c), replays=10)
            except Exception as exc:  # a tile too large for shared memory: skip it
                print(f"{shape} {config}: {type(exc).__name__}: {exc}"[:300], flush=True)
                continue
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            found.append({"shape": shape, "prompt_len": length, "beam_width": beam_width,
                          **dataclasses.asdict(config), "ms": ms,
                          "roofline_fraction": floor_ms / ms, "max_rel_err": err})  # fmt: skip
        rows += found
        for r in found:
            print(
                f"{shape:<13}{length:>6}{beam_width:>5} {r['block_m']:>4} "
                f"{r['merge_block_m']:>4} {r['num_stages']:>2} {r['num_splits'] or 0:>2} "
                f"{r['ms'] * 1e3:8.1f} us roofline {r['roofline_fraction']:.2f}"
                f"  err {r['max_rel_err']:.1e}",
                flush=True,
            )
    return rows, ceilings


def split_sweep(prompt_lens, beam_widths) -> list[dict]:
    """Time the default tiles with 1, 2, 4 and 8 splits and with ``choose_num_splits``'s
    count, one request, on the grids that do not fill the GPU (the split rule's domain)."""
    from xgr.kernels.decode_attention_launch import choose_num_splits

    rows = []
    warm_up_clocks()
    for shape, length, beam_width in itertools.product(SHAPES, prompt_lens, beam_widths):
        p = Problem(shape, length, beam_width, 1)
        row_blocks = -(-beam_width * (p.num_heads // p.num_kv_heads) // DEFAULT_LAUNCH.block_m)
        auto = choose_num_splits(row_blocks * p.num_kv_heads, p.q.device)
        times = {}
        for splits in (1, 2, 4, 8):
            config = dataclasses.replace(DEFAULT_LAUNCH, num_splits=splits)
            times[splits] = bench(lambda c=config, p=p: p.run(config=c), replays=20)
        rows.append({"shape": shape, "prompt_len": length, "beam_width": beam_width,
                     "auto_splits": auto, "ms_by_splits": times})  # fmt: skip
        cells = "".join(f"{times[n] * 1e3:8.1f}" for n in (1, 2, 4, 8))
        print(f"{shape:<13}{length:>6}{beam_width:>5}  auto {auto}{cells}", flush=True)
    return rows


def flash_varlen(q, k, v, cu_dev, max_seqlen, scale):
    """PyTorch's packed variable-length flash attention (FA2), causal: the baseline the
    Triton kernel replaced; None where this PyTorch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"scale": scale}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)  # causal
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = q.shape[1] != k.shape[1]
    return varlen_attn(q, k, v, cu_dev, cu_dev, max_seqlen, max_seqlen, **kwargs)


def prefill(ceilings, prompt_lens=PROMPT_LENGTHS, requests_list=REQUESTS) -> list[dict]:
    """Packed causal prefill attention per layer: xgr's packed Triton launch (as
    ``prefill_attention`` runs it), PyTorch's packed flash attention and SDPA per prompt,
    each against the FLOP floor."""
    rows = []
    for shape, length, requests in itertools.product(SHAPES, prompt_lens, requests_list):
        num_heads, num_kv_heads, head_dim = SHAPES[shape]
        total = length * requests
        q = torch.randn(total, num_heads, head_dim, device="cuda", dtype=DTYPE)
        k = torch.randn(total, num_kv_heads, head_dim, device="cuda", dtype=DTYPE)
        v = torch.randn_like(k)
        cu = [i * length for i in range(requests + 1)]
        cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
        scale = head_dim**-0.5
        per_prompt_ms = bench(
            lambda q=q, k=k, v=v, cu=cu, s=scale: prefill_attention_reference(q, k, v, cu, s),
            calls=2,
        )
        ms = bench(
            lambda q=q, k=k, v=v, cu=cu, s=scale, c=cu_dev, n=length: prefill_attention(
                q, k, v, cu, s, c, n, packed=True
            ),
            calls=2,
        )
        flash = flash_varlen(q, k, v, cu_dev, length, scale)
        flash_ms = None
        if flash is not None:
            flash_ms = bench(
                lambda q=q, k=k, v=v, c=cu_dev, n=length, s=scale: flash_varlen(q, k, v, c, n, s),
                calls=2,
            )
        ref = prefill_attention_reference(q.float(), k.float(), v.float(), cu, scale)
        out = prefill_attention(q, k, v, cu, scale, cu_dev, length, packed=True).float()
        flops = requests * 2 * length * length * num_heads * head_dim  # causal: half of 4LLHD
        floor_ms = 1e3 * flops / ceilings["bf16_matmul_flop_per_s"]
        rows.append(
            {
                "shape": shape,
                "prompt_len": length,
                "requests": requests,
                "triton_packed_ms": ms,
                "flash_varlen_ms": flash_ms,
                "sdpa_per_prompt_ms": per_prompt_ms,
                "flops": flops,
                "roofline_fraction": floor_ms / ms,
                "rel_err": ((out - ref).norm() / ref.norm()).item(),
            }
        )
        flash_text = "   n/a" if flash_ms is None else f"{flash_ms * 1e3:8.1f} us"
        print(
            f"prefill {shape:<13}{length:>6}{requests:>3} triton {ms * 1e3:8.1f} us"
            f" (err {rows[-1]['rel_err']:.1e}) flash varlen {flash_text}"
            f" per-prompt {per_prompt_ms * 1e3:8.1f} us"
            f" roofline {rows[-1]['roofline_fraction']:5.2f}",
            flush=True,
        )
    return rows


# T5 encoder attention shapes (heads, d_kv) of t5_latency.py: OneRec-like and TIGER-size.
ENCODER_SHAPES = {"t5-onerec-like": (16, 64), "t5-tiger": (6, 64)}
ENCODER_LENGTHS = (256, 1024)


def encoder(ceilings, requests_list=REQUESTS) -> list[dict]:
    """T5 encoder self-attention per layer over prompts padded to one length: xgr's Triton
    kernel, with the bias read per score and with one bias for the key tiles beyond T5's
    max_distance (128), against SDPA with the square bias + padding mask, each prompt one
    token short of the padded length."""
    from xgr.kernels.encoder_attention import padded_biased_attention_reference, square_mask
    from xgr.kernels.triton_encoder_attention import padded_biased_attention
    from xgr.layers.relative_position import offset_position_bias

    rows = []
    for (shape, (heads, dim)), length, slots in itertools.product(
        ENCODER_SHAPES.items(), ENCODER_LENGTHS, requests_list
    ):
        qkv = torch.randn(slots * length, 3, heads, dim, device="cuda", dtype=DTYPE)
        q, k, v = qkv.unbind(1)
        lengths = torch.full((slots,), length - 1, device="cuda")
        table = torch.randn(32, heads, device="cuda", dtype=DTYPE)
        bias = offset_position_bias(table, length, True, 128)
        args = (q, k, v, lengths, bias, length)
        # The engine builds the square mask once per encode and reuses it in every layer:
        # SDPA is timed with a built mask, the build on its own.
        mask = square_mask(lengths, bias, length, DTYPE)
        qs, ks, vs = (t.view(slots, length, heads, dim).transpose(1, 2) for t in (q, k, v))
        sdpa_ms = bench(
            lambda q=qs, k=ks, v=vs, m=mask: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=m, scale=1.0
            ),
            calls=2,
        )
        mask_ms = bench(lambda a=(lengths, bias, length, DTYPE): square_mask(*a), calls=2)
        triton_ms = bench(lambda a=args: padded_biased_attention(*a), calls=2)
        far_ms = bench(lambda a=args: padded_biased_attention(*a, constant_beyond=128), calls=2)
        ref = padded_biased_attention_reference(*(t.float() for t in args[:3]), *args[3:]).float()
        out = padded_biased_attention(*args).float()
        far_out = padded_biased_attention(*args, constant_beyond=128).float()
        real = torch.arange(slots * length, device="cuda") % length < length - 1
        err = ((out - ref)[real].norm() / ref[real].norm()).item()
        far_err = ((far_out - ref)[real].norm() / ref[real].norm()).item()
        flops = slots * 4 * length * length * heads * dim
        floor_ms = 1e3 * flops / ceilings["bf16_matmul_flop_per_s"]
        rows.append(
            {
                "shape": shape,
                "padded_len": length,
                "prompts": slots,
                "triton_ms": triton_ms,
                "triton_far_bias_ms": far_ms,
                "sdpa_square_mask_ms": sdpa_ms,
                "square_mask_build_ms": mask_ms,  # once per encode, not per layer
                "flops": flops,
                "roofline_fraction": floor_ms / triton_ms,
                "rel_err": err,
                "far_bias_rel_err": far_err,
            }
        )
        print(
            f"encoder {shape:<15}{length:>6}{slots:>3} triton {triton_ms * 1e3:8.1f} us"
            f" far bias {far_ms * 1e3:8.1f} us (err {far_err:.1e})"
            f" sdpa+mask {sdpa_ms * 1e3:8.1f} us (mask build {mask_ms * 1e3:.1f} us per"
            f" encode) err {err:.1e}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True, help="JSON file to write")
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="tune launch parameters only, one request over --prompt-lens x --beam-widths",
    )
    parser.add_argument("--prefill", action="store_true", help="time prefill attention only")
    parser.add_argument(
        "--encoder",
        action="store_true",
        help="time T5 encoder attention only (its own lengths, 256 and 1024)",
    )
    # Configuration filters (the decode table; --prefill reads the lengths and requests).
    parser.add_argument(
        "--split-sweep",
        action="store_true",
        help="time 1/2/4/8 splits for one request over --prompt-lens x --beam-widths",
    )
    parser.add_argument(
        "--profile-launch",
        action="store_true",
        help="only run xgr's default launch 3 times per configuration, untimed and without "
        "graphs, for a kernel profiler (gpu_phases.sh ncu); writes no JSON",
    )
    parser.add_argument("--prompt-lens", type=int, nargs="*", default=PROMPT_LENGTHS)
    parser.add_argument("--beam-widths", type=int, nargs="*", default=BEAM_WIDTHS)
    parser.add_argument("--requests", type=int, nargs="*", default=REQUESTS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (it times CUDA-graph replays)")
    report = {
        "benchmark": "decode attention per layer per step (last step of 3, 2 beam tokens)",
        **run_environment(),
        "dtype": str(DTYPE),
        "launch_config": dataclasses.asdict(DEFAULT_LAUNCH),
    }
    if args.profile_launch:
        for config in itertools.product(SHAPES, args.prompt_lens, args.beam_widths, args.requests):
            problem = Problem(*config)
            for _ in range(3):
                problem.run(rotate=False)
        torch.cuda.synchronize()
        return
    if args.split_sweep:
        print(f"{'shape':<13}{'L':>6}{'B':>5}  splits: auto  1 / 2 / 4 / 8 (us)")
        report["split_sweep"] = split_sweep(args.prompt_lens, args.beam_widths)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.sweep:
        report["sweep"], report["ceilings"] = sweep(args.prompt_lens, args.beam_widths)
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        return
    ceilings = measure_ceilings()
    if args.encoder:
        report.update(ceilings=ceilings, encoder=encoder(ceilings, args.requests))
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        return
    if args.prefill:
        report.update(ceilings=ceilings, prefill=prefill(ceilings, args.prompt_lens, args.requests))
        args.output.write_text(json.dumps(report, indent=2) + "\n")
        return
    header = (
        f"{'shape':<13}{'L':>6}{'B':>5}{'R':>3}{'xgr us':>9}{'eager':>8}{'1 split':>9}{'staged':>9}"
        f"{'sdpa us':>10}{'x sdpa':>8}{'roofline':>9}{'bound':>8}{'reorder':>9}"
        f"{'ancestry':>9}{'err':>9}"
    )
    print(header, flush=True)
    results, lines = [], []
    for config in itertools.product(SHAPES, args.prompt_lens, args.beam_widths, args.requests):
        r = run_config(*config, ceilings)
        torch.cuda.empty_cache()  # the per-beam SDPA copies of the last configuration
        results.append(r)
        sdpa = f"{r['sdpa_ms'] * 1e3:10.1f}" if r["sdpa_ms"] else f"{'skipped':>10}"
        speed = f"{r['speedup_vs_sdpa']:8.1f}" if r["speedup_vs_sdpa"] else f"{'-':>8}"
        lines.append(
            f"{r['shape']:<13}{r['prompt_len']:>6}{r['beam_width']:>5}{r['requests']:>3}"
            f"{r['xgr_ms'] * 1e3:9.1f}{r['xgr_eager_ms'] * 1e3:8.1f}"
            f"{r['one_split_ms'] * 1e3:9.1f}"
            f"{r['staged_one_split_ms'] * 1e3:9.1f}{sdpa}{speed}{r['roofline_fraction']:9.2f}"
            f"{r['bound']:>8}{r['reorder_copy_ms'] * 1e3:9.1f}"
            f"{r['xgr_ancestry_rows_ms'] * 1e3:9.1f}{r['max_rel_err']:9.1e}"
        )
        print(lines[-1], flush=True)
    copy_tb = ceilings["copy_bandwidth_bytes_per_s"] / 1e12
    matmul_tf = ceilings["bf16_matmul_flop_per_s"] / 1e12
    print(f"\nceilings: copy {copy_tb:.2f} TB/s, bf16 matmul {matmul_tf:.0f} TFLOP/s (times in us)")
    print("\n".join([header, *lines]))
    report.update(ceilings=ceilings, results=results)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
