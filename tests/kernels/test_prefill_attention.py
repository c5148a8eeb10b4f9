"""Packed causal prefill attention equals each prompt run alone with naive causal softmax."""

from __future__ import annotations

import pytest
import torch

from xgr.kernels.prefill_attention import (
    packed_available,
    prefill_attention,
    prefill_attention_reference,
)


def naive_causal(q, k, v, scale):
    """One prompt: q (L, H, D), k/v (L, Hkv, D) -> (L, H, D) float64; token t sees 0..t."""
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    length = q.shape[0]
    future = torch.arange(length)[None, :] > torch.arange(length)[:, None]  # [t, s]: s > t
    probs = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("hts,shd->thd", probs, v)


def packed_inputs(lengths, num_heads, num_kv_heads, head_dim, dtype=torch.float32):
    total = sum(lengths)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q = torch.randn(total, num_heads, head_dim).to(dtype)
    k = torch.randn(total, num_kv_heads, head_dim).to(dtype)
    v = torch.randn(total, num_kv_heads, head_dim).to(dtype)
    return q, k, v, cu


@pytest.mark.parametrize("lengths", [[1], [9], [5, 1, 13], [1, 1], [16, 2]], ids=str)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (8, 1)], ids=str)
def test_prefill_equals_naive_causal_per_prompt(num_heads, num_kv_heads, head_dim, lengths):
    q, k, v, cu = packed_inputs(lengths, num_heads, num_kv_heads, head_dim)
    scale = head_dim**-0.5
    out = prefill_attention_reference(q, k, v, cu, scale)
    assert out.shape == q.shape
    assert out.dtype == q.dtype
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        expected = naive_causal(q[start:end], k[start:end], v[start:end], scale)
        torch.testing.assert_close(out[start:end].double(), expected, rtol=1e-5, atol=1e-5)


def test_prefill_first_token_returns_its_own_value():
    # Causality: the first token of every prompt attends only to itself.
    q, k, v, cu = packed_inputs([3, 1, 4], 4, 2, 16)
    out = prefill_attention_reference(q, k, v, cu, 0.25)
    for start in cu[:-1]:
        torch.testing.assert_close(out[start], v[start].repeat_interleave(2, dim=0))


def test_prefill_prompts_are_independent_and_causal():
    q, k, v, cu = packed_inputs([4, 6], 4, 2, 16)
    base = prefill_attention_reference(q, k, v, cu, 0.25)
    # Changing the last token of prompt 0 changes only that token's output.
    v2 = v.clone()
    v2[3] += 1.0
    out = prefill_attention_reference(q, k, v2, cu, 0.25)
    changed = [t for t in range(10) if not torch.equal(out[t], base[t])]
    assert changed == [3]
    # Changing prompt 1's first token changes all of prompt 1 and none of prompt 0.
    k2 = k.clone()
    k2[4] += 1.0
    v2 = v.clone()
    v2[4] += 1.0
    out = prefill_attention_reference(q, k2, v2, cu, 0.25)
    changed = [t for t in range(10) if not torch.equal(out[t], base[t])]
    assert changed == list(range(4, 10))


def test_prefill_scale_is_used():
    q, k, v, cu = packed_inputs([7], 4, 4, 16)
    out = prefill_attention_reference(q, k, v, cu, 0.9)
    torch.testing.assert_close(out.double(), naive_causal(q, k, v, 0.9), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, prefill_attention_reference(q, k, v, cu, 0.1))


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.bfloat16, 2**-5), (torch.float16, 2**-8)])
def test_prefill_low_precision(dtype, rtol):
    q, k, v, cu = packed_inputs([5, 1, 11], 8, 2, 64, dtype)
    out = prefill_attention_reference(q, k, v, cu, 0.125)
    assert out.dtype == dtype
    for start, end in zip(cu[:-1], cu[1:], strict=True):
        expected = naive_causal(q[start:end], k[start:end], v[start:end], 0.125)
        err = (out[start:end].double() - expected).abs()
        assert torch.all(err <= rtol * (expected.abs() + 1.0)), float(err.max())


def test_prefill_attention_falls_back_to_the_reference_on_cpu():
    q, k, v, cu = packed_inputs([3, 7], 4, 2, 16)
    assert not packed_available(q)
    with pytest.raises(ValueError, match="packed prefill attention needs CUDA"):
        prefill_attention(q, k, v, cu, 0.25, packed=True)
    torch.testing.assert_close(
        prefill_attention(q, k, v, cu, 0.25), prefill_attention_reference(q, k, v, cu, 0.25)
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the packed launch needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(16, 8, 128), (14, 2, 64), (4, 4, 64)], ids=str
)
def test_packed_prefill_matches_the_reference_on_gpu(num_heads, num_kv_heads, head_dim, dtype):
    lengths = torch.randint(1, 700, (5,)).tolist() + [1, 1000]
    q, k, v, cu = (
        t.cuda() if isinstance(t, torch.Tensor) else t
        for t in packed_inputs(lengths, num_heads, num_kv_heads, head_dim, dtype)
    )
    assert packed_available(q)
    scale = head_dim**-0.5
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    out = prefill_attention(q, k, v, cu, scale, cu_dev, max(lengths), packed=True)
    ref = prefill_attention_reference(q.float(), k.float(), v.float(), cu, scale)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    rel = (out.float() - ref).norm() / ref.norm()
    assert rel < 1e-2, rel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN's output layout needs CUDA")
def test_one_prompt_is_sdpa_output_in_place_on_gpu():
    # One prompt skips the copy into a packed output: the result is SDPA's own output,
    # token-major (contiguous), so the output projection reads it without a copy either.
    q, k, v, cu = (
        t.cuda() if isinstance(t, torch.Tensor) else t
        for t in packed_inputs([1000], 16, 8, 128, torch.bfloat16)
    )
    out = prefill_attention_reference(q, k, v, cu, 128**-0.5)
    assert out.shape == q.shape and out.is_contiguous()
    expected = naive_causal(q.cpu(), k.cpu(), v.cpu(), 128**-0.5)
    rel = (out.double().cpu() - expected).norm() / expected.norm()
    assert rel < 1e-2, rel
