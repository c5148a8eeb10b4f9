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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "inter"), [(3, 100), (17, 4864), (0, 64)], ids=str)
def test_silu_mul_matches_reference(rows, inter, dtype):
    gate, up = randn(rows, inter, dtype=dtype, scale=4), randn(rows, inter, dtype=dtype)
    assert_close(kernels.silu_mul(gate, up), F.silu(gate) * up, dtype)
    with pytest.raises(ValueError, match="must match"):
        kernels.silu_mul(gate, up[:, :-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "inter"), [(3, 100), (9, 4096), (0, 64)], ids=str)
def test_gelu_tanh_mul_matches_reference(rows, inter, dtype):
    # Strided halves of one buffer, as T5's fused wi GEMM gives them.
    fused = randn(rows, 2 * inter, dtype=dtype, scale=4)
    gate, up = fused.chunk(2, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    assert_close(kernels.gelu_tanh_mul(gate, up), want, dtype)
    if dtype == torch.float32 and rows:
        # The negative tail against float64 (float32 torch rounds 1 + tanh(z) there, and a
        # 1 - 1 / (1 + e^2z) form cancels to 0): relative error, not only absolute.
        tail = torch.tensor([[-5.0, -4.0, -3.0, -2.0]], device=DEVICE)
        got = kernels.gelu_tanh_mul(tail, torch.ones_like(tail))
        exact = F.gelu(tail.double(), approximate="tanh").float()
        torch.testing.assert_close(got, exact, atol=0, rtol=1e-5)
    with pytest.raises(ValueError, match="must match"):
        kernels.gelu_tanh_mul(gate, up[:, :-1])


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
