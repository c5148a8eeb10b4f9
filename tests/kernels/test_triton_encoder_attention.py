"""The Triton encoder attention (T5 position bias by offset, padded prompts) against its torch
reference, and the reference against a direct evaluation of the biased softmax.

On the CPU the kernel runs under Triton's interpreter; on a GPU compiled. Outputs are
poisoned (NaN) before each run so an element the kernel fails to write shows up.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from xgr.kernels import triton_encoder_attention as kernel_module  # noqa: E402
from xgr.kernels.encoder_attention import padded_biased_attention_reference  # noqa: E402
from xgr.layers.relative_position import (  # noqa: E402
    offset_position_bias,
    square_position_bias,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def make_inputs(lengths, padded_len, heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = len(lengths) * padded_len
    # One fused projection, split: q, k, v are strided views, as the T5 layers pass them.
    qkv = torch.randn(rows, 3, heads, head_dim, generator=gen).to(dtype=dtype, device=DEVICE)
    q, k, v = qkv.unbind(1)
    table = torch.randn(32, heads, generator=gen).to(dtype=dtype, device=DEVICE)
    bias = offset_position_bias(table, padded_len, True, 128)
    return q, k, v, torch.tensor(lengths, device=DEVICE), bias


def naive(q, k, v, lengths, bias, padded_len):
    """Each prompt's softmax(q k^T + bias[key - query]) v over its real keys, float64."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for s, length in enumerate(lengths.tolist()):
        span = slice(s * padded_len, (s + 1) * padded_len)
        qs, ks, vs = (t[span].double().cpu() for t in (q, k, v))
        pos = torch.arange(padded_len)
        square = bias.double().cpu()[:, pos[None, :] - pos[:, None] + padded_len - 1]
        scores = torch.einsum("ihd,jhd->hij", qs, ks) + square
        scores[:, :, length:] = float("-inf")
        out[span] = torch.einsum("hij,jhd->ihd", scores.softmax(-1), vs)
    return out


@pytest.mark.parametrize(
    ("lengths", "padded_len", "heads", "head_dim"),
    [
        ([1, 1], 1, 2, 16),  # P = 1: the (heads, 1) bias may have any last stride
        ([5], 5, 2, 16),
        ([1, 37, 20], 40, 3, 32),
        ([70, 9], 70, 2, 64),
        ([16, 33], 48, 1, 128),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_kernel_equals_the_reference(monkeypatch, lengths, padded_len, heads, head_dim, dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter does not compute in bfloat16; checked on the GPU")
    q, k, v, lens, bias = make_inputs(lengths, padded_len, heads, head_dim, dtype, padded_len)
    empty = torch.empty
    monkeypatch.setattr(
        kernel_module.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
    )
    got = kernel_module.padded_biased_attention(
        q, k, v, lens, bias, padded_len, block_m=16, block_n=16
    )
    monkeypatch.undo()
    want = padded_biased_attention_reference(q, k, v, lens, bias, padded_len)
    assert got.shape == q.shape and got.dtype == dtype
    assert not torch.isnan(got).any()
    error = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert error < TOLERANCE[dtype], float(error)


@pytest.mark.parametrize(("lengths", "padded_len"), [([70, 9, 41], 70), ([128], 128), ([3], 96)])
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (32, 16), (16, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_far_tiles_take_one_bias_and_equal_the_reference(
    monkeypatch, lengths, padded_len, block_m, block_n, dtype
):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("Triton's CPU interpreter does not compute in bfloat16; checked on the GPU")
    # 8 buckets with max_distance 6: offsets 6 or more away share one bias per direction,
    # so most key tiles lie beyond it.
    q, k, v, lens, _ = make_inputs(lengths, padded_len, 2, 32, dtype, padded_len + block_m)
    table = torch.randn(8, 2, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEVICE)
    bias = offset_position_bias(table, padded_len, True, 6)
    empty = torch.empty
    monkeypatch.setattr(
        kernel_module.torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan"))
    )
    got = kernel_module.padded_biased_attention(
        q, k, v, lens, bias, padded_len, constant_beyond=6, block_m=block_m, block_n=block_n
    )
    # A distance the table is not constant beyond: the scalar tiles then differ, so the
    # test above would see it if they were not taken.
    wrong = kernel_module.padded_biased_attention(
        q, k, v, lens, bias, padded_len, constant_beyond=2, block_m=block_m, block_n=block_n
    )
    monkeypatch.undo()
    want = padded_biased_attention_reference(q, k, v, lens, bias, padded_len)
    assert not torch.isnan(got).any()
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() / scale < TOLERANCE[dtype]
    if max(lengths) > 2 * block_n + 8:
        assert (wrong.float() - want.float()).abs().max() / scale > 10 * TOLERANCE[dtype]


def test_reference_equals_the_biased_softmax_and_the_square_bias():
    q, k, v, lens, bias = make_inputs([3, 11], 12, 2, 16, torch.float32, 0)
    want = naive(q, k, v, lens, bias, 12)
    got = padded_biased_attention_reference(q, k, v, lens, bias, 12)
    torch.testing.assert_close(got.double().cpu(), want, atol=1e-5, rtol=1e-5)
    # The per-offset bias is the square bias's diagonals.
    table = torch.randn(32, 2)
    square = square_position_bias(table, 12, True, 128)
    pos = torch.arange(12)
    offsets = offset_position_bias(table, 12, True, 128)
    assert torch.equal(offsets[:, pos[None, :] - pos[:, None] + 11], square)


def test_bad_arguments_are_refused():
    q, k, v, lens, bias = make_inputs([3, 5], 6, 2, 16, torch.float32, 1)
    call = kernel_module.padded_biased_attention
    with pytest.raises(ValueError, match="padded to 5"):
        call(q, k, v, lens, bias, 5)
    with pytest.raises(ValueError, match="lengths must be"):
        call(q, k, v, lens[:1], bias, 6)
    with pytest.raises(ValueError, match="bias_by_offset must be"):
        call(q, k, v, lens, bias[:, :-1], 6)
    with pytest.raises(ValueError, match="head_dim"):
        call(*(t[..., :12] for t in (q, k, v)), lens, bias, 6)
    with pytest.raises(ValueError, match="one dtype"):
        call(q, k.half(), v.half(), lens, bias, 6)
    with pytest.raises(ValueError, match="constant_beyond"):
        call(q, k, v, lens, bias, 6, constant_beyond=0)


@pytest.mark.parametrize(
    ("lengths", "padded_len", "heads"), [([1], 1, 2), ([5, 2], 5, 3), ([70, 9, 1], 70, 2)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_square_mask_kernel_equals_the_torch_mask(lengths, padded_len, heads, dtype):
    from xgr.kernels.encoder_attention import square_mask

    *_, lengths_t, bias = make_inputs(lengths, padded_len, heads, 16, dtype, seed=padded_len)
    got = kernel_module.square_mask(lengths_t, bias, padded_len, dtype)
    expected = square_mask(lengths_t, bias, padded_len, dtype)
    assert got.shape == (len(lengths), heads, padded_len, padded_len) and got.dtype == dtype
    assert torch.equal(got, expected)  # copies of the same values, and -inf
    assert torch.isneginf(got[0, :, :, lengths[0] :]).all()


def test_square_mask_kernel_refuses_misshapen_bias():
    bias = torch.zeros(2, 7, device=DEVICE)
    with pytest.raises(ValueError, match="bias_by_offset"):
        kernel_module.square_mask(torch.tensor([3], device=DEVICE), bias, 5, torch.float32)
