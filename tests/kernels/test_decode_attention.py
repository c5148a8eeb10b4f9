"""The staged decode-attention reference equals naive per-beam softmax attention."""

from __future__ import annotations

import math

import pytest
import torch

from xgr.kernels.decode_attention import (
    decode_attention_reference,
    merge_attention_states,
    shared_attention_reference,
    unshared_attention_reference,
)

HEADS = [(4, 4), (4, 2), (8, 1)]
PROMPTS = [[1], [7, 1, 12], [3, 20]]  # prompt lengths of the requests of one batch


def make_inputs(num_heads, num_kv_heads, head_dim, prompt_lens, beam_width, beam_tokens, dtype):
    rows = len(prompt_lens) * beam_width
    total = sum(prompt_lens)
    cu = [0]
    for n in prompt_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(rows, num_heads, head_dim).to(dtype)
    shared_k = torch.randn(total, num_kv_heads, head_dim).to(dtype)
    shared_v = torch.randn(total, num_kv_heads, head_dim).to(dtype)
    beam_k = torch.randn(rows, beam_tokens, num_kv_heads, head_dim).to(dtype)
    beam_v = torch.randn(rows, beam_tokens, num_kv_heads, head_dim).to(dtype)
    return q, shared_k, shared_v, cu, beam_k, beam_v


def naive_attention(q, k, v, scale):
    """q (H, D), k/v (L, Hkv, D) -> out (H, D), lse (H,), scores (H, L); float64 throughout."""
    group = q.shape[0] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)  # head h reads KV head h // group
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.double(), k) * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hl,lhd->hd", probs, v), torch.logsumexp(scores, dim=-1), scores


def naive_decode(q, shared_k, shared_v, cu, beam_k, beam_v, beam_width, scale):
    """Each beam's query over [its request's prompt KV ; its own beam KV], one beam at a time."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for row in range(q.shape[0]):
        r = row // beam_width
        prompt = slice(cu[r], cu[r + 1])
        k = torch.cat([shared_k[prompt], beam_k[row]], dim=0)
        v = torch.cat([shared_v[prompt], beam_v[row]], dim=0)
        out[row] = naive_attention(q[row], k, v, scale)[0]
    return out


@pytest.mark.parametrize("beam_tokens", [1, 2, 3])
@pytest.mark.parametrize("prompt_lens", PROMPTS, ids=str)
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=str)
def test_decode_reference_equals_naive_float32(
    num_heads, num_kv_heads, head_dim, prompt_lens, beam_tokens
):
    beam_width = 3
    inputs = make_inputs(
        num_heads, num_kv_heads, head_dim, prompt_lens, beam_width, beam_tokens, torch.float32
    )
    scale = head_dim**-0.5
    got = decode_attention_reference(*inputs, beam_width, scale)
    expected = naive_decode(*inputs, beam_width, scale)
    assert got.dtype == torch.float32
    assert got.shape == (len(prompt_lens) * beam_width, num_heads, head_dim)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("dtype", "rtol"), [(torch.bfloat16, 2**-7), (torch.float16, 2**-10)], ids=str
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=str)
def test_decode_reference_low_precision(num_heads, num_kv_heads, dtype, rtol):
    beam_width, head_dim = 4, 64
    inputs = make_inputs(num_heads, num_kv_heads, head_dim, [5, 1, 17], beam_width, 2, dtype)
    scale = head_dim**-0.5
    got = decode_attention_reference(*inputs, beam_width, scale)
    assert got.dtype == dtype
    # The oracle sees the same low-precision inputs, so the only error left is the final
    # rounding of the output to dtype (half an ulp) plus float32 arithmetic.
    expected = naive_decode(*inputs, beam_width, scale)
    err = (got.double() - expected).abs()
    assert torch.all(err <= rtol * expected.abs() + 1e-4), float(err.max())


def test_decode_reference_scale_and_beam_width_one():
    # beam_width 1 and a non-default scale; very different prompt lengths.
    inputs = make_inputs(4, 2, 16, [1, 40], 1, 1, torch.float32)
    got = decode_attention_reference(*inputs, 1, 0.7)
    torch.testing.assert_close(got.double(), naive_decode(*inputs, 1, 0.7), rtol=1e-5, atol=1e-5)


def test_decode_reference_rows_use_their_own_request_and_beam():
    # Changing one request's prompt KV changes only that request's rows; changing one
    # beam's KV changes only that beam's row.
    beam_width = 2
    q, sk, sv, cu, bk, bv = make_inputs(4, 2, 16, [3, 4], beam_width, 2, torch.float32)
    base = decode_attention_reference(q, sk, sv, cu, bk, bv, beam_width, 0.25)
    sv2 = sv.clone()
    sv2[cu[1] :] += 1.0
    out = decode_attention_reference(q, sk, sv2, cu, bk, bv, beam_width, 0.25)
    assert torch.equal(out[:beam_width], base[:beam_width])
    assert not torch.allclose(out[beam_width:], base[beam_width:])
    bv2 = bv.clone()
    bv2[1] += 1.0
    out = decode_attention_reference(q, sk, sv, cu, bk, bv2, beam_width, 0.25)
    changed = [i for i in range(out.shape[0]) if not torch.equal(out[i], base[i])]
    assert changed == [1]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=str)
def test_shared_attention_lse_and_out(num_heads, num_kv_heads):
    beam_width, head_dim = 3, 16
    q, sk, sv, cu, _, _ = make_inputs(
        num_heads, num_kv_heads, head_dim, [6, 1, 9], beam_width, 1, torch.float32
    )
    scale = head_dim**-0.5
    out, lse = shared_attention_reference(q, sk, sv, cu, beam_width, scale)
    assert out.dtype == lse.dtype == torch.float32
    assert lse.shape == (q.shape[0], num_heads)
    for row in range(q.shape[0]):
        r = row // beam_width
        exp_out, exp_lse, scores = naive_attention(
            q[row], sk[cu[r] : cu[r + 1]], sv[cu[r] : cu[r + 1]], scale
        )
        torch.testing.assert_close(
            lse[row].double(), torch.logsumexp(scores, -1), rtol=0, atol=1e-5
        )
        torch.testing.assert_close(lse[row].double(), exp_lse, rtol=0, atol=1e-5)
        torch.testing.assert_close(out[row].double(), exp_out, rtol=1e-5, atol=1e-5)


def test_shared_attention_single_token_prompt_lse_is_the_score():
    q, sk, sv, cu, _, _ = make_inputs(4, 2, 16, [1], 2, 1, torch.float32)
    out, lse = shared_attention_reference(q, sk, sv, cu, 2, 0.25)
    k = sk[0].repeat_interleave(2, dim=0)  # (H, D)
    torch.testing.assert_close(lse, (q * k).sum(-1) * 0.25, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, sv[0].repeat_interleave(2, dim=0).expand_as(out))


def test_unshared_attention_lse_and_out():
    q = torch.randn(5, 8, 16)
    k = torch.randn(5, 3, 2, 16)
    v = torch.randn(5, 3, 2, 16)
    out, lse = unshared_attention_reference(q, k, v, 0.3)
    for row in range(5):
        exp_out, exp_lse, _ = naive_attention(q[row], k[row], v[row], 0.3)
        torch.testing.assert_close(out[row].double(), exp_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[row].double(), exp_lse, rtol=0, atol=1e-5)


def test_empty_prompt_gives_beam_only_attention():
    # A zero-length prompt is an empty shared part (lse -inf): the result is attention over
    # the beam's own tokens alone.
    q, sk, sv, _, bk, bv = make_inputs(4, 2, 16, [3], 2, 2, torch.float32)
    out_s, lse_s = shared_attention_reference(q, sk, sv, [0, 0], 2, 0.25)
    assert torch.all(lse_s == -math.inf)
    got = decode_attention_reference(q, sk, sv, [0, 0], bk, bv, 2, 0.25)
    expected, _ = unshared_attention_reference(q, bk, bv, 0.25)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def random_part(rows=6, heads=4, head_dim=16, length=5):
    """Partial attention state over `length` random keys: (out, lse, q, k, v)."""
    q = torch.randn(rows, heads, head_dim)
    k = torch.randn(rows, length, heads, head_dim)
    v = torch.randn(rows, length, heads, head_dim)
    out, lse = unshared_attention_reference(q, k, v, 0.25)
    return out, lse, q, k, v


def test_merge_with_empty_part_is_exact():
    out_b, lse_b, *_ = random_part()
    out_a = torch.randn_like(out_b)  # garbage values under an empty part
    lse_a = torch.full_like(lse_b, -math.inf)
    for out, lse in (
        merge_attention_states(out_a, lse_a, out_b, lse_b),
        merge_attention_states(out_b, lse_b, out_a, lse_a),
    ):
        assert torch.equal(out, out_b)
        assert torch.equal(lse, lse_b)


def test_merge_with_partly_empty_rows():
    out_a, lse_a, *_ = random_part()
    out_b, lse_b, *_ = random_part()
    lse_a = lse_a.clone()
    lse_a[2] = -math.inf  # row 2 of part a is empty
    out, lse = merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert torch.equal(out[2], out_b[2])
    assert torch.equal(lse[2], lse_b[2])
    other = [i for i in range(6) if i != 2]
    assert not torch.allclose(out[other], out_b[other])


def test_merge_equals_attention_over_union():
    q = torch.randn(3, 4, 16)
    ks = [torch.randn(3, n, 2, 16) for n in (1, 4, 7)]
    vs = [torch.randn(3, n, 2, 16) for n in (1, 4, 7)]
    parts = [unshared_attention_reference(q, k, v, 0.25) for k, v in zip(ks, vs, strict=True)]
    union = unshared_attention_reference(q, torch.cat(ks, 1), torch.cat(vs, 1), 0.25)
    (oa, la), (ob, lb), (oc, lc) = parts
    merged = merge_attention_states(*merge_attention_states(oa, la, ob, lb), oc, lc)
    torch.testing.assert_close(merged[0], union[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(merged[1], union[1], rtol=1e-5, atol=1e-6)


def test_merge_is_associative_and_commutative():
    (oa, la, *_), (ob, lb, *_), (oc, lc, *_) = (random_part(length=n) for n in (2, 5, 9))
    a, b, c = (oa, la), (ob, lb), (oc, lc)
    results = [
        merge_attention_states(*merge_attention_states(*a, *b), *c),  # (a b) c
        merge_attention_states(*a, *merge_attention_states(*b, *c)),  # a (b c)
        merge_attention_states(*merge_attention_states(*c, *a), *b),  # (c a) b
        merge_attention_states(*b, *merge_attention_states(*c, *a)),  # b (c a)
        merge_attention_states(*merge_attention_states(*b, *a), *c),  # (b a) c
    ]
    for out, lse in results[1:]:
        torch.testing.assert_close(out, results[0][0], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(lse, results[0][1], rtol=1e-6, atol=1e-6)
    # Commutative on two parts, bit for bit (IEEE addition commutes).
    ab, ba = merge_attention_states(*a, *b), merge_attention_states(*b, *a)
    assert torch.equal(ab[0], ba[0])
    assert torch.equal(ab[1], ba[1])
