"""The Triton beam self-attention (T5 decoder) against its torch reference.

On the CPU it runs under Triton's interpreter; outputs and the written cache slot are
poisoned (NaN) first, so an element the kernel fails to write shows up.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels.beam_self_attention import (  # noqa: E402
    beam_self_attention_reference,
    start_and_codes_attention_reference,
)
from xgr.kernels.triton_beam_self_attention import (  # noqa: E402
    beam_self_attention,
    start_and_codes_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def make_case(rows, heads, head_dim, capacity, slot, query_rows, dtype, gen):
    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    qkv = randn(query_rows, 3, heads, head_dim)  # strided views, as from a fused GEMM
    q, k_new, v_new = qkv.unbind(1)
    beam_k, beam_v = randn(rows, capacity, heads, head_dim), randn(rows, capacity, heads, head_dim)
    beam_k[:, slot] = beam_v[:, slot] = float("nan")  # the slot the step must write
    ancestry = torch.randint(0, rows, (rows, capacity), generator=gen, dtype=torch.int32)
    ancestry[:, slot:] = torch.arange(rows, dtype=torch.int32)[:, None]  # unwritten: identity
    kv_rows = torch.randperm(rows, generator=gen)[:query_rows]
    bias = randn(heads, slot + 1)
    return q, k_new, v_new, beam_k, beam_v, ancestry.to(DEVICE), kv_rows.to(DEVICE), slot, bias


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("rows", "heads", "head_dim", "slot", "query_rows"),
    [(8, 4, 16, 0, 8), (12, 6, 64, 2, 12), (10, 3, 24, 3, 4), (64, 16, 64, 1, 64)],
)
def test_kernel_equals_the_reference(dtype, rows, heads, head_dim, slot, query_rows):
    gen = torch.Generator().manual_seed(rows * 31 + slot)
    case = make_case(rows, heads, head_dim, slot + 2, slot, query_rows, dtype, gen)
    q, k_new, v_new, beam_k, beam_v, ancestry, kv_rows, slot, bias = case
    ref_k, ref_v = beam_k.clone(), beam_v.clone()
    want = beam_self_attention_reference(
        q, k_new, v_new, ref_k, ref_v, ancestry, kv_rows, slot, bias
    )
    got = beam_self_attention(q, k_new, v_new, beam_k, beam_v, ancestry, kv_rows, slot, bias)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # The same slots written (and others untouched): NaN-poisoned rows equal only if written.
    torch.testing.assert_close(beam_k, ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(beam_v, ref_v, equal_nan=True, atol=0, rtol=0)
    assert not beam_k[kv_rows, slot].isnan().any()


def test_strided_kv_rows_read_the_right_rows():
    gen = torch.Generator().manual_seed(3)
    q, k_new, v_new, beam_k, beam_v, ancestry, _, slot, bias = make_case(
        8, 2, 8, 3, 1, 4, torch.float32, gen
    )
    kv_rows = torch.arange(8, device=DEVICE)[::2]  # stride 2
    ref_k, ref_v = beam_k.clone(), beam_v.clone()
    want = beam_self_attention_reference(
        q, k_new, v_new, ref_k, ref_v, ancestry, kv_rows, slot, bias
    )
    got = beam_self_attention(q, k_new, v_new, beam_k, beam_v, ancestry, kv_rows, slot, bias)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(beam_k, ref_k, equal_nan=True, atol=0, rtol=0)


def test_bad_shapes_are_refused():
    gen = torch.Generator().manual_seed(0)
    q, k_new, v_new, beam_k, beam_v, ancestry, kv_rows, slot, bias = make_case(
        6, 2, 8, 3, 1, 6, torch.float32, gen
    )
    with pytest.raises(ValueError, match="must match"):
        beam_self_attention(q, k_new[:3], v_new, beam_k, beam_v, ancestry, kv_rows, slot, bias)
    with pytest.raises(ValueError, match="slot 3"):
        beam_self_attention(q, k_new, v_new, beam_k, beam_v, ancestry, kv_rows, 3, bias)
    with pytest.raises(ValueError, match="bias"):
        beam_self_attention(q, k_new, v_new, beam_k, beam_v, ancestry, kv_rows, slot, bias[:, :1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("requests", "per_request", "heads", "head_dim"),
    [(1, 5, 4, 16), (3, 7, 6, 64), (2, 1, 3, 24), (4, 17, 16, 64)],
)
def test_start_and_codes_kernel_equals_the_reference(dtype, requests, per_request, heads, head_dim):
    gen = torch.Generator().manual_seed(requests * 131 + per_request)
    rows = requests * per_request

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)

    q, k, v = randn(rows, 3, heads, head_dim).unbind(1)
    # Two more beam rows than the pass (never written) and a third slot (never written).
    beam_k = torch.full((rows + 2, 3, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    beam_v = beam_k.clone()
    bias = randn(heads, 2)
    ref_k, ref_v = beam_k.clone(), beam_v.clone()
    want = start_and_codes_attention_reference(q, k, v, ref_k, ref_v, per_request, bias)
    got = start_and_codes_attention(q, k, v, beam_k, beam_v, per_request, bias)
    assert not got.isnan().any()
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(beam_k, ref_k, equal_nan=True, atol=0, rtol=0)
    torch.testing.assert_close(beam_v, ref_v, equal_nan=True, atol=0, rtol=0)
    starts = torch.arange(0, rows, per_request, device=DEVICE)
    torch.testing.assert_close(got[starts], v[starts], atol=0, rtol=0)  # a start sees itself
    codes = torch.ones(rows, dtype=torch.bool, device=DEVICE)
    codes[starts] = False
    # Slot 0 of a start's row and slot 1 of a code's row hold its K; the other stays NaN.
    assert torch.equal(beam_k[starts, 0], k[starts]) and beam_k[starts, 1].isnan().all()
    assert torch.equal(beam_k[:rows][codes, 1], k[codes])
    assert beam_k[:rows][codes, 0].isnan().all()


def test_start_and_codes_reference_by_hand():
    # One request: a start token, then one code; one head of size 1.
    q = torch.tensor([[[2.0]], [[1.0]]])
    k = torch.tensor([[[0.5]], [[1.5]]])
    v = torch.tensor([[[3.0]], [[-1.0]]])
    beam = torch.zeros(2, 2, 1, 1)
    bias = torch.tensor([[0.25, -0.5]])
    out = start_and_codes_attention_reference(q, k, v, beam, beam.clone(), 2, bias)
    s0, s1 = 1.0 * 0.5 + 0.25, 1.0 * 1.5 - 0.5
    p0 = torch.exp(torch.tensor(s0)) / (torch.exp(torch.tensor(s0)) + torch.exp(torch.tensor(s1)))
    assert out[0, 0, 0] == 3.0
    torch.testing.assert_close(out[1, 0, 0], p0 * 3.0 + (1 - p0) * -1.0)


def test_start_and_codes_launcher_checks():
    q = torch.zeros(6, 2, 16, device=DEVICE)
    beam = torch.zeros(6, 2, 2, 16, device=DEVICE)
    bias = torch.zeros(2, 2, device=DEVICE)
    with pytest.raises(ValueError, match="not requests of 4 rows"):
        start_and_codes_attention(q, q, q, beam, beam.clone(), 4, bias)
    with pytest.raises(ValueError, match="do not hold slots 0-1"):
        one_slot = beam[:, :1].contiguous()
        start_and_codes_attention(q, q, q, one_slot, one_slot.clone(), 3, bias)
    with pytest.raises(ValueError, match="must be"):
        start_and_codes_attention(q, q, q, beam, beam.clone(), 3, bias[:, :1])
