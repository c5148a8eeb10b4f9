"""PyTorch's own attention kernels against xgr's, on the GPU.

Where a library kernel might replace or split part of xgr's attention.

Device time per call (CUDA-graph replays, ``timing.graph_ms``; the inputs stay in L2 between
calls) and relative error against a float32 reference, bf16, one request:

- the shared (prompt) part of decode attention, Qwen3-1.7B shape (16 / 8 heads, head_dim
  128), at (L, B) = (3000, 512), (1000, 256), (5000, 256): xgr's kernel (prompt only, and
  with two beam tokens as the engine runs it) against cuDNN's and flash attention's SDPA
  kernels with the query heads of each KV head stacked as rows (both return the
  log-sum-exp that a merge with the beam tokens needs), the same with the prompt cut into
  2 or 4 parts run as a batch (a merge would then combine the parts; its cost is not in
  the figure), and SDPA with ``enable_gqa``;
- T5 cross-attention (16 heads, d_kv 64, 1023 keys, 512 beams): xgr's kernel against SDPA;
- T5 encoder attention over one 1024-token prompt with a relative position bias: SDPA with
  the square mask (as the engine runs it), xgr's Triton kernel reading the bias per offset
  (its default launch and 64 x 64 tiles with 3 stages), and FlexAttention with the bias as
  a ``score_mod``.

    python benchmarks/attention_libraries.py --output benchmarks/results/attention-libraries.json
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import matmul_flop_rate  # noqa: E402
from timing import graph_ms, run_environment  # noqa: E402

from xgr.kernels.encoder_attention import square_mask  # noqa: E402
from xgr.kernels.triton_decode_attention import (  # noqa: E402
    beam_decode_attention,
    shared_decode_attention,
)
from xgr.kernels.triton_encoder_attention import padded_biased_attention  # noqa: E402
from xgr.layers.relative_position import offset_position_bias  # noqa: E402

DTYPE = torch.bfloat16
DECODE_CASES = ((3000, 512), (1000, 256), (5000, 256))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def cudnn_attention(q, k, v):
    """(output, logsumexp) of cuDNN's SDPA kernel, no mask, default scale."""
    out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False)
    return out[0], out[1]


def flash_attention(q, k, v):
    """(output, logsumexp) of PyTorch's flash attention kernel, no mask, default scale."""
    out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False)
    return out[0], out[1]


class Table:
    """Rows of (kernel, us, TFLOP/s, error), printed as they come."""

    def __init__(self) -> None:
        self.rows: list[dict] = []

    def add(self, name: str, fn, flops: float, error=None) -> None:
        try:
            ms = graph_ms(fn)
        except Exception as exc:  # a library kernel that refuses this shape
            print(f"{name:<52} failed: {exc!r}"[:160], flush=True)
            self.rows.append({"kernel": name, "failed": repr(exc)[:300]})
            return
        rate = flops / (ms * 1e-3)
        self.rows.append(
            {"kernel": name, "us": ms * 1e3, "tflop_per_s": rate / 1e12, "error": error}
        )
        print(f"{name:<52}{ms * 1e3:8.1f} us{rate / 1e12:7.0f} TF/s  error {error}", flush=True)


def decode_shared(table: Table, length: int, beams: int) -> None:
    heads, kv_heads, dim = 16, 8, 128
    group, scale = heads // kv_heads, dim**-0.5
    q = torch.randn(beams, heads, dim, device="cuda", dtype=DTYPE)
    k = torch.randn(length, kv_heads, dim, device="cuda", dtype=DTYPE)
    v = torch.randn_like(k)
    cu = torch.tensor([0, length], device="cuda")
    beam_k = torch.randn(beams, 3, kv_heads, dim, device="cuda", dtype=DTYPE)
    beam_rows = torch.arange(beams, device="cuda", dtype=torch.int32)[:, None].repeat(1, 3)
    flops = 4 * beams * heads * length * dim
    scores = torch.einsum("bhgd,lhd->bhgl", q.float().view(beams, kv_heads, group, dim), k.float())
    scores = scores * scale
    want = torch.einsum("bhgl,lhd->bhgd", scores.softmax(-1), v.float()).reshape(beams, heads, dim)
    want_lse = torch.logsumexp(scores, -1).reshape(beams, heads)
    tag = f"L={length} B={beams}"
    xgr = functools.partial(shared_decode_attention, q, k, v, cu, beams, scale)
    table.add(f"xgr prompt part {tag}", xgr, flops, relative_error(xgr(), want))
    with_beam = functools.partial(
        beam_decode_attention, q, k, v, cu, beam_k, beam_k, beam_rows, 2, beams, scale
    )
    table.add(f"xgr prompt + 2 beam tokens {tag}", with_beam, flops)
    # Query heads of one KV head stacked as rows: (1, kv_heads, beams * group, dim).
    stacked = q.view(beams, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, dim)
    k_heads, v_heads = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    for name, kernel in (("cudnn", cudnn_attention), ("flash", flash_attention)):
        run = functools.partial(kernel, stacked, k_heads, v_heads)
        try:
            out, lse = run()
        except Exception as exc:
            print(f"{name} {tag} failed: {exc!r}"[:160], flush=True)
            continue
        out = (
            out[0].view(kv_heads, beams, group, dim).permute(1, 0, 2, 3).reshape(beams, heads, dim)
        )
        lse = lse[0].view(kv_heads, beams, group).permute(1, 0, 2).reshape(beams, heads)
        error = [relative_error(out, want), (lse - want_lse).abs().max().item()]
        table.add(f"{name} stacked heads {tag}", run, flops, error)
        for parts in (2, 4):
            if length % parts == 0:
                k_parts = k.view(parts, length // parts, kv_heads, dim).transpose(1, 2)
                v_parts = v.view(parts, length // parts, kv_heads, dim).transpose(1, 2)
                q_parts = stacked.expand(parts, -1, -1, -1)
                split = functools.partial(kernel, q_parts, k_parts, v_parts)
                table.add(f"{name} prompt in {parts} parts (no merge) {tag}", split, flops)
    q_heads = q.transpose(0, 1)[None]
    gqa = functools.partial(
        F.scaled_dot_product_attention, q_heads, k_heads, v_heads, enable_gqa=True
    )
    error = relative_error(gqa()[0].transpose(0, 1), want)
    table.add(f"sdpa enable_gqa {tag}", gqa, flops, error)


def t5_cross(table: Table) -> None:
    heads, dim, length, beams = 16, 64, 1023, 512
    q = torch.randn(beams, heads, dim, device="cuda", dtype=DTYPE) * 0.3
    k = torch.randn(length, heads, dim, device="cuda", dtype=DTYPE) * 0.3
    v = torch.randn(length, heads, dim, device="cuda", dtype=DTYPE)
    cu = torch.tensor([0, length], device="cuda")
    flops = 4 * beams * heads * length * dim
    probs = torch.einsum("bhd,lhd->hbl", q.float(), k.float()).softmax(-1)
    want = torch.einsum("hbl,lhd->bhd", probs, v.float())
    xgr = functools.partial(shared_decode_attention, q, k, v, cu, beams, 1.0)
    table.add("xgr T5 cross-attention", xgr, flops, relative_error(xgr(), want))
    heads_first = [t.transpose(0, 1)[None] for t in (q, k, v)]
    sdpa = functools.partial(F.scaled_dot_product_attention, *heads_first, scale=1.0)
    table.add(
        "sdpa T5 cross-attention", sdpa, flops, relative_error(sdpa()[0].transpose(0, 1), want)
    )


def t5_encoder(table: Table, length: int = 1024) -> None:
    heads, dim = 16, 64
    bias = offset_position_bias(
        torch.randn(32, heads, device="cuda", dtype=DTYPE), length, True, 128
    )
    lengths = torch.tensor([length], device="cuda")
    mask = square_mask(lengths, bias, length, DTYPE)
    q, k, v = (
        torch.randn(1, heads, length, dim, device="cuda", dtype=DTYPE) * s for s in (0.3, 0.3, 1)
    )
    flops = 4 * heads * length * length * dim
    want = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=1.0
    )
    sdpa = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, scale=1.0)
    table.add(
        f"sdpa + square mask T5 encoder P={length}", sdpa, flops, relative_error(sdpa(), want)
    )
    token_major = [t[0].transpose(0, 1).contiguous() for t in (q, k, v)]
    for launch in ((), (64, 64, 4, 3)):
        triton = functools.partial(
            padded_biased_attention, *token_major, lengths, bias, length, *launch
        )
        got = triton().view(length, heads, dim).transpose(0, 1)[None]
        name = "default" if not launch else "x".join(map(str, launch))
        table.add(
            f"xgr Triton ({name}) T5 encoder P={length}", triton, flops, relative_error(got, want)
        )
    from torch.nn.attention.flex_attention import flex_attention

    def score_mod(score, batch, head, q_idx, kv_idx):
        return score + bias[head, kv_idx - q_idx + length - 1].float()

    flex = functools.partial(
        torch.compile(flex_attention, dynamic=False), q, k, v, score_mod=score_mod, scale=1.0
    )
    table.add(f"FlexAttention T5 encoder P={length}", flex, flops, relative_error(flex(), want))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (it times CUDA-graph replays)")
    rate = matmul_flop_rate("cuda")
    print(f"bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)
    table = Table()
    for length, beams in DECODE_CASES:
        decode_shared(table, length, beams)
    t5_cross(table)
    t5_encoder(table)
    report = {
        "benchmark": "library attention kernels against xgr's (benchmarks/attention_libraries.py)",
        **run_environment(),
        "dtype": "bfloat16",
        "bf16_matmul_flop_per_s": rate,
        "timing": "CUDA-graph replays, median device time per call; inputs stay in L2",
        "error": "relative error against float32 (cudnn/flash: and the log-sum-exp's largest gap)",
        "results": table.rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
