"""The fused elementwise Triton kernels against the torch references of ``xgr.layers``.

On the CPU they run under Triton's interpreter (float32 only); on a GPU compiled, bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels import triton_elementwise as kernels  # noqa: E402
from xgr.layers.norm import rms_norm_reference  # noqa: E402
from xgr.layers.rotary import apply_rope_reference, rope_cos_sin  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
# float32: only rsqrt/exp/FMA rounding; half types: at most one rounding step of the output.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def randn(*shape, dtype, scale=1.0):
    return (torch.randn(*shape) * scale).to(dtype=dtype, device=DEVICE)


def assert_close(got, expected, dtype):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if not got.numel():
        return
    assert torch.isfinite(got).all()
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "dim"), [(1, 64), (37, 896), (5, 2048), (0, 128)], ids=str)
def test_rms_norm_matches_reference(rows, dim, dtype):
    x, delta = randn(rows, dim, dtype=dtype, scale=3), randn(rows, dim, dtype=dtype)
    weight = randn(dim, dtype=dtype)
    assert_close(kernels.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), dtype)
    total, normed = kernels.rms_norm(x, weight, 1e-6, residual=delta)
    assert torch.equal(total, x + delta)  # the sum is rounded exactly as the reference's add
    assert_close(normed, rms_norm_reference(x + delta, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_heads_normalizes_each_head(dtype):
    q = randn(9, 14, 64, dtype=dtype)
    weight = randn(64, dtype=dtype)
    assert_close(kernels.rms_norm(q, weight, 1e-5), rms_norm_reference(q, weight, 1e-5), dtype)


def test_rms_norm_reads_a_strided_weight_correctly():
    x, weight = randn(4, 16, dtype=torch.float32), randn(32, dtype=torch.float32)[::2]
    assert_close(
        kernels.rms_norm(x, weight, 1e-6), rms_norm_reference(x, weight, 1e-6), torch.float32
    )


def test_rms_norm_rejects_bad_arguments():
    x = randn(3, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="at least 1"):
        kernels.rms_norm(randn(3, 0, dtype=torch.float32), randn(0, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        kernels.rms_norm(x, randn(4, dtype=torch.float32), 1e-6)
    with pytest.raises(ValueError, match="residual must match"):
        kernels.rms_norm(x, randn(8, dtype=torch.float32), 1e-6, randn(2, 8, dtype=torch.float32))


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "inter"), [(3, 100), (5, 1500), (0, 64)], ids=str)
def test_gated_mul_interleaved_matches_reference(rows, inter, dtype, act):
    gate_up = randn(rows, 2 * inter, dtype=dtype, scale=4)
    gate, up = gate_up[:, 0::2], gate_up[:, 1::2]
    want = (F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")) * up
    assert_close(kernels.gated_mul_interleaved(gate_up, act), want, dtype)
    with pytest.raises(ValueError, match="must be"):
        kernels.gated_mul_interleaved(gate_up[:, 1:], act)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.gated_mul_interleaved(randn(2 * inter, 4, dtype=dtype).t(), act)
    with pytest.raises(ValueError, match="act must be"):
        kernels.gated_mul_interleaved(gate_up, "relu")
    with pytest.raises(ValueError, match="floats"):
        kernels.gated_mul_interleaved(torch.ones(2, 4, dtype=torch.int32, device=DEVICE))


def test_gelu_tanh_keeps_the_negative_tail():
    # Against float64 (float32 torch rounds 1 + tanh(z) there, and a 1 - 1 / (1 + e^2z)
    # form cancels to 0): relative error, not only absolute.
    tail = torch.tensor([-5.0, -4.0, -3.0, -2.0], device=DEVICE)
    gate_up = torch.stack([tail, torch.ones_like(tail)], dim=1).reshape(1, 8)
    got = kernels.gated_mul_interleaved(gate_up, "gelu_tanh")
    exact = F.gelu(tail.double(), approximate="tanh").float()[None]
    torch.testing.assert_close(got, exact, atol=0, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("heads", "head_dim"), [(2, 64), (16, 128), (3, 16)], ids=str)
def test_rope_matches_reference(heads, head_dim, dtype):
    tokens = 11
    positions = torch.randint(0, 5000, (tokens,), device=DEVICE)
    cos, sin = rope_cos_sin(positions, head_dim, 1e6, dtype)
    x = randn(tokens, heads, head_dim, dtype=dtype)
    assert_close(kernels.apply_rope(x, cos, sin), apply_rope_reference(x, cos, sin), dtype)
    # A strided view (q out of a fused projection) is read through its strides.
    wide = randn(tokens, heads + 1, head_dim, dtype=dtype)[:, 1:]
    assert_close(kernels.apply_rope(wide, cos, sin), apply_rope_reference(wide, cos, sin), dtype)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.apply_rope(x, cos[:-1], sin[:-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("norm", [False, True], ids=["no-norm", "qk-norm"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (14, 2, 64), (16, 8, 128)])
def test_qkv_heads_matches_reference(heads, kv_heads, head_dim, norm, dtype):
    from xgr.layers.attention import qkv_heads_reference

    tokens, slots, slot = 13, 3, 1
    width = (heads + 2 * kv_heads) * head_dim
    qkv = randn(tokens, width + 8, dtype=dtype, scale=3)[:, 4 : 4 + width]  # strided rows
    cos, sin = rope_cos_sin(torch.randint(0, 5000, (tokens,), device=DEVICE), head_dim, 1e6, dtype)
    weights = (randn(head_dim, dtype=dtype), randn(head_dim, dtype=dtype)) if norm else ()

    def cache():  # a beam KV layout: (rows, slots, kv_heads, head_dim), poisoned
        return torch.full((tokens, slots, kv_heads, head_dim), float("nan"), dtype=dtype,
                          device=DEVICE)  # fmt: skip

    got_k, got_v, want_k, want_v = cache(), cache(), cache(), cache()
    q = kernels.qkv_heads(qkv, heads, kv_heads, cos, sin, got_k[:, slot], got_v[:, slot],
                          *weights, eps=1e-6)  # fmt: skip
    want_q = qkv_heads_reference(
        qkv, heads, kv_heads, cos, sin, want_k[:, slot], want_v[:, slot], *weights, eps=1e-6
    )
    assert q.is_contiguous() and q.shape == (tokens, heads, head_dim)
    assert_close(q, want_q, dtype)
    assert_close(got_k[:, slot], want_k[:, slot], dtype)
    assert torch.equal(got_v[:, slot], want_v[:, slot])  # v is copied, not rounded
    others = [s for s in range(slots) if s != slot]
    assert torch.isnan(got_k[:, others]).all() and torch.isnan(got_v[:, others]).all()


def test_qkv_heads_rejects_bad_arguments():
    qkv = randn(3, 4 * 16, dtype=torch.float32)
    cos, sin = rope_cos_sin(torch.arange(3, device=DEVICE), 16, 1e4, torch.float32)
    k, v = randn(3, 1, 16, dtype=torch.float32), randn(3, 1, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="does not hold"):
        kernels.qkv_heads(qkv[:, :-1], 2, 1, cos, sin, k, v)
    with pytest.raises(ValueError, match="k_out must be"):
        kernels.qkv_heads(qkv, 2, 1, cos, sin, k[:2], v)
    with pytest.raises(ValueError, match="both q and k norm"):
        kernels.qkv_heads(qkv, 2, 1, cos, sin, k, v, randn(16, dtype=torch.float32))
    with pytest.raises(ValueError, match="do not fit"):
        kernels.qkv_heads(qkv, 2, 1, cos[:2], sin[:2], k, v)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.qkv_heads(qkv, 2, 1, cos, sin[:1], k, v)  # would read past sin's end
