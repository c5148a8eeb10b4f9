"""The packed causal prefill Triton kernel against the per-prompt SDPA reference.

On the CPU it runs under Triton's interpreter (float32); on a GPU compiled, bf16/fp16 too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels.prefill_attention import prefill_attention_reference  # noqa: E402
from xgr.kernels.triton_prefill_attention import packed_causal_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# Small tiles keep the interpreter quick and put several tiles (and their diagonal) in a prompt.
TILES = dict(block_m=16, block_n=8) if DEVICE == "cpu" else {}


def packed(lengths, heads, kv_heads, head_dim, dtype):
    gen = torch.Generator().manual_seed(sum(lengths) + heads + head_dim)
    total = sum(lengths)
    q, k, v = (
        torch.randn(total, h, head_dim, generator=gen).to(device=DEVICE, dtype=dtype)
        for h in (heads, kv_heads, kv_heads)
    )
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return q, k, v, cu


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lengths", [[1], [37], [5, 1, 40], [16, 16], [8, 33, 2]], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (7, 1, 32), (2, 2, 64)])
def test_packed_causal_attention_matches_sdpa_per_prompt(lengths, heads, kv_heads, head_dim, dtype):
    q, k, v, cu = packed(lengths, heads, kv_heads, head_dim, dtype)
    scale = head_dim**-0.5
    cu_dev = torch.tensor(cu, dtype=torch.int32, device=DEVICE)
    got = packed_causal_attention(q, k, v, cu_dev, max(lengths), scale, **TILES)
    want = prefill_attention_reference(q.float(), k.float(), v.float(), cu, scale)
    assert got.dtype == dtype and got.shape == q.shape
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err <= TOLERANCE[dtype], err


def test_a_larger_length_bound_and_a_strided_input_change_nothing():
    # A graph passes a power-of-two bound on the longest prompt; q may be a column view of
    # the fused projection, k and v slices of a larger KV pool.
    q, k, v, cu = packed([3, 21, 9], 4, 2, 16, torch.float32)
    wide_q = torch.randn(q.shape[0], 6, 16, device=DEVICE)
    wide_q[:, 1:5] = q
    pool_k = torch.randn(q.shape[0] + 7, 2, 16, device=DEVICE)
    pool_v = torch.randn_like(pool_k)
    pool_k[: q.shape[0]], pool_v[: q.shape[0]] = k, v
    cu_dev = torch.tensor(cu, device=DEVICE)
    want = packed_causal_attention(q, k, v, cu_dev, 21, 0.25, **TILES)
    got = packed_causal_attention(
        wide_q[:, 1:5], pool_k[: q.shape[0]], pool_v[: q.shape[0]], cu_dev, 64, 0.25, **TILES
    )
    torch.testing.assert_close(got, want)


def test_each_prompt_is_independent_and_its_first_token_sees_only_itself():
    q, k, v, cu = packed([6, 5], 2, 1, 16, torch.float32)
    cu_dev = torch.tensor(cu, device=DEVICE)
    out = packed_causal_attention(q, k, v, cu_dev, 6, 0.25, **TILES)
    for start in cu[:-1]:
        torch.testing.assert_close(out[start], v[start].expand(2, 16))
    k2, v2 = k.clone(), v.clone()
    k2[6:], v2[6:] = torch.randn_like(k2[6:]), torch.randn_like(v2[6:])  # the second prompt
    out2 = packed_causal_attention(q, k2, v2, cu_dev, 6, 0.25, **TILES)
    torch.testing.assert_close(out2[:6], out[:6])


def test_bad_arguments_are_refused():
    q, k, v, cu = packed([4], 4, 2, 16, torch.float32)
    cu_dev = torch.tensor(cu, device=DEVICE)
    with pytest.raises(ValueError, match="does not fit"):
        packed_causal_attention(q, k[:, :1].repeat(1, 3, 1), v[:, :1].repeat(1, 3, 1), cu_dev, 4, 1)
    with pytest.raises(ValueError, match="head_dim"):
        packed_causal_attention(q[..., :12], k[..., :12], v[..., :12], cu_dev, 4, 1)
    with pytest.raises(ValueError, match="multiple of block_n"):
        packed_causal_attention(q, k, v, cu_dev, 4, 1, block_m=24, block_n=16)
    with pytest.raises(ValueError, match="cu_seqlens"):
        packed_causal_attention(q, k, v, torch.tensor([[0, 4]], device=DEVICE), 4, 1)
