"""FP8 projections: weight quantization, the torch reference and the quantizing modules."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from xgr.core import XgrError
from xgr.layers.fp8 import (
    Fp8Linear,
    Fp8RMSNorm,
    Fp8Rows,
    fp8_linear_reference,
    quantize_rows_reference,
    quantize_weight,
)
from xgr.layers.norm import RMSNorm, rms_norm_reference


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    got, expected = got.detach().float(), expected.detach().float()
    return float((got - expected).norm() / expected.norm())


def test_quantize_weight_per_channel_and_per_tensor():
    weight = torch.randn(32, 64)
    weight[3] *= 100.0  # one channel far larger than the rest
    values, scales = quantize_weight(weight)
    assert values.dtype == torch.float8_e4m3fn and scales.shape == (32,)
    torch.testing.assert_close(scales, weight.abs().amax(1) / 448.0)
    assert relative_error(values.float() * scales[:, None], weight) < 0.05
    tensor_values, tensor_scales = quantize_weight(weight, per_channel=False)
    assert tensor_scales.shape == (1,)
    torch.testing.assert_close(tensor_scales[0], weight.abs().amax() / 448.0)
    # The large channel coarsens every other channel under one scale.
    small = slice(4, 32)
    per_tensor = relative_error((tensor_values.float() * tensor_scales)[small], weight[small])
    per_channel = relative_error((values.float() * scales[:, None])[small], weight[small])
    assert per_channel < per_tensor


def test_fp8_linear_reference_is_the_dequantized_product():
    rows = quantize_rows_reference(torch.randn(5, 32))
    weight, scale = quantize_weight(torch.randn(48, 32))
    bias = torch.randn(48).bfloat16()
    out = fp8_linear_reference(rows, weight, scale, bias)
    expected = rows.dequantize() @ (weight.float() * scale[:, None]).T + bias.float()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_linear_is_within_e4m3_rounding_of_bf16(per_tensor):
    torch.manual_seed(0)
    linear = nn.Linear(256, 512).bfloat16()
    x = torch.randn(64, 256).bfloat16()
    fp8 = Fp8Linear.from_linear(linear, per_channel=not per_tensor)
    assert fp8.weight.dtype == torch.float8_e4m3fn and fp8.bias.dtype == torch.bfloat16
    assert fp8.per_tensor == per_tensor
    # e4m3 keeps 3 mantissa bits: about 2.5% rounding error per factor.
    assert relative_error(fp8(x), linear(x)) < 0.06
    # Rows quantized before, as the passes that write FP8 give them, give the same output.
    assert torch.equal(fp8(quantize_rows_reference(x, per_tensor)), fp8(x))
    # Rows of the other granularity are taken too (their scales repeated).
    assert relative_error(fp8(quantize_rows_reference(x, not per_tensor)), linear(x)) < 0.06


def test_per_tensor_rows_share_one_scale():
    x = torch.randn(6, 32)
    x[4] *= 30.0
    rows = quantize_rows_reference(x, per_tensor=True)
    assert rows.scales.shape == (1, 1)
    torch.testing.assert_close(rows.scales[0, 0], x.abs().amax() / 448.0)
    assert rows.values.float().abs().amax() == 448.0
    assert relative_error(rows.dequantize()[4], x[4]) < 0.05


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_linear_takes_no_rows(per_tensor):
    layer = Fp8Linear.from_linear(nn.Linear(32, 16, bias=False), per_channel=not per_tensor)
    out = layer(torch.zeros(0, 32, dtype=torch.bfloat16))
    assert out.shape == (0, 16) and out.dtype == torch.bfloat16
    rows = quantize_rows_reference(torch.zeros(0, 32), per_tensor)
    assert rows.scales.shape == ((1, 1) if per_tensor else (0, 1))
    if per_tensor:  # the all-zero scale, as the Triton pass writes for no rows
        assert float(rows.scales) == pytest.approx(1e-12 / 448)


def test_fp8_linear_refuses_unaligned_sizes():
    with pytest.raises(XgrError, match="multiples of 16"):
        Fp8Linear.from_linear(nn.Linear(24, 32))


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_rms_norm_writes_quantized_rows(per_tensor):
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    fp8 = Fp8RMSNorm.from_norm(norm, per_tensor)
    x, residual = torch.randn(7, 64), torch.randn(7, 64)
    rows = fp8(x)
    assert isinstance(rows, Fp8Rows) and rows.shape == (7, 64)
    assert rows.scales.shape == ((1, 1) if per_tensor else (7, 1))
    assert relative_error(rows.dequantize(), rms_norm_reference(x, norm.weight, 1e-6)) < 0.05
    total, rows = fp8(x, residual)
    assert torch.equal(total, x + residual)
    expected = quantize_rows_reference(
        rms_norm_reference(x + residual, norm.weight, 1e-6), per_tensor
    )
    assert torch.equal(rows.values.float(), expected.values.float())
    assert torch.equal(rows.scales, expected.scales)
