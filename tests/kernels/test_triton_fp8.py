"""The FP8-writing Triton passes against their torch references (``xgr.layers.fp8``).

On the CPU they run under Triton's interpreter (float32 inputs); on a GPU compiled, bf16 too.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels import triton_fp8 as kernels  # noqa: E402
from xgr.layers.fp8 import quantize_rows_reference  # noqa: E402
from xgr.layers.norm import rms_norm_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def assert_same_fp8(values, scales, expected) -> None:
    """Equal scales and e4m3 values, every row written (poisoned outputs are never 0-filled)."""
    assert values.dtype == torch.float8_e4m3fn and scales.shape == expected.scales.shape
    torch.testing.assert_close(scales, expected.scales, rtol=1e-6, atol=0)
    assert torch.equal(values.float(), expected.values.float())


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim,scale", [(1, 16, 1.0), (37, 96, 1e-3), (70, 300, 50.0)])
def test_quantize_rows_matches_reference(rows, dim, scale, dtype, per_tensor):
    x = (torch.randn(rows, dim) * scale).to(dtype=dtype, device=DEVICE)
    x[0, : dim // 2] *= 1e-6  # values in e4m3's subnormal range
    if rows > 2:
        x[2] = 0.0  # an all-zero row: tiny scale, zero values
    if rows > 60:
        x[61, 7] = 40 * scale  # the tensor's amax in a late program's rows
    assert_same_fp8(*kernels.quantize_rows(x, per_tensor), quantize_rows_reference(x, per_tensor))


@pytest.mark.parametrize("per_tensor", [False, True])
def test_quantize_rows_of_zeros_and_of_no_rows(per_tensor):
    for x in (torch.zeros(5, 32, device=DEVICE), torch.zeros(0, 32, device=DEVICE)):
        values, scales = kernels.quantize_rows(x, per_tensor)
        assert values.shape == x.shape and not values.float().any()
        assert scales.shape == ((1, 1) if per_tensor else (x.shape[0], 1))
        assert torch.all(scales == torch.tensor(1e-12) / 448)


def test_quantize_rows_rounds_to_nearest_on_the_whole_grid():
    # Every e4m3 interval, ties included: where rounding up carries into the exponent too.
    x = torch.linspace(-448, 448, 40001, device=DEVICE)[None].repeat(2, 1)
    x[1] = x[1] / 448 * 0.02  # the subnormal step's neighbourhood
    values, scales = kernels.quantize_rows(x)
    assert_same_fp8(values, scales, quantize_rows_reference(x))


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_matches_reference(with_residual, dtype, per_tensor):
    x = torch.randn(33, 128).to(dtype=dtype, device=DEVICE)
    weight = (torch.rand(128) + 0.5).to(dtype=dtype, device=DEVICE)
    weight[5] = 4.0  # one channel larger: the per-tensor amax comes from it
    residual = torch.randn_like(x) if with_residual else None
    out = kernels.rms_norm_fp8(x, weight, 1e-6, residual, per_tensor)
    total = x if residual is None else x + residual
    expected = quantize_rows_reference(rms_norm_reference(total, weight, 1e-6), per_tensor)
    if residual is None:
        assert_same_fp8(*out, expected)
    else:
        assert torch.equal(out[0], total)
        assert_same_fp8(*out[1], expected)


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("rows,inter", [(5, 48), (40, 200)])
def test_gated_mul_fp8_matches_reference(rows, inter, act, dtype, per_tensor):
    gate_up = torch.randn(rows, 2 * inter).to(dtype=dtype, device=DEVICE)
    fn = F.silu if act == "silu" else (lambda t: F.gelu(t, approximate="tanh"))
    expected = quantize_rows_reference(fn(gate_up[:, 0::2]) * gate_up[:, 1::2], per_tensor)
    values, scales = kernels.gated_mul_fp8(gate_up, act, per_tensor)
    torch.testing.assert_close(scales, expected.scales, rtol=1e-5, atol=0)
    # exp's float32 rounding may move a product across an e4m3 rounding boundary.
    assert (values.float() == expected.values.float()).float().mean() >= 0.995


def test_launchers_refuse_bad_inputs():
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        kernels.quantize_rows(torch.zeros(4, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        kernels.quantize_rows(torch.zeros(8, 4, device=DEVICE).t())
    with pytest.raises(ValueError, match="2 I >= 2"):
        kernels.gated_mul_fp8(torch.zeros(4, 7, device=DEVICE))
    with pytest.raises(ValueError, match="act must be"):
        kernels.gated_mul_fp8(torch.zeros(4, 8, device=DEVICE), "relu")
    with pytest.raises(ValueError, match="weight must be"):
        kernels.rms_norm_fp8(torch.zeros(4, 8, device=DEVICE), torch.ones(7, device=DEVICE), 1e-6)
