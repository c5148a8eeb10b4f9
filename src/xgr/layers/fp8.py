"""FP8 (e4m3) projections: y = (x / s_x) (W / s_w)^T * s_x * s_w.

Each factor is in e4m3 with float32 scales, accumulated in float32 and written in bf16
(``torch._scaled_mm``), at one of two granularities:

- per tensor (``per_tensor=True``): one dynamic scale for all of x (``xgr.kernels.triton_fp8``
  computes it as it writes x) and one for W, fixed at load: cuBLAS's per-tensor FP8 GEMM;
- per row: a dynamic scale per token row of x and one per output channel of W: finer
  resolution and one pass to write x; the row-wise scaled GEMM is slower on Hopper, but whole
  requests are faster (docs/performance.md), so ``quantization="fp8"`` uses it.

The passes that produce a projection's input write it quantized (``Fp8RMSNorm``,
``Fp8GatedMLP``); other inputs are quantized on entry. The LM head and the code
log-probabilities are not quantized, so scores stay normalized log-probabilities.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from xgr.core import XgrError
from xgr.layers.norm import RMSNorm, rms_norm_reference

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
MIN_AMAX = 1e-12  # an all-zero row's scale is taken from this, not 0
# The dtype FP8 projections write (torch._scaled_mm's row-wise scaling writes bf16).
FP8_OUT_DTYPE = torch.bfloat16


@dataclass(frozen=True)
class Fp8Rows:
    """Token rows in e4m3 with one scale each: row t is ``values[t] * scales[t]``.

    Attributes:
        values: (T, K) float8_e4m3fn.
        scales: (T, 1) float32, each row's amax / 448; or (1, 1), the whole tensor's.
    """

    values: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.values.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(T, K) in ``dtype``: values * scales computed in float32."""
        return (self.values.float() * self.scales).to(dtype)


def quantize_rows_reference(x: torch.Tensor, per_tensor: bool = False) -> Fp8Rows:
    """Each row of (T, K) ``x`` in e4m3 with scale max(amax, ``MIN_AMAX``) / 448, amax the
    row's (or, ``per_tensor``, the whole tensor's) largest magnitude: the torch reference of
    ``xgr.kernels.triton_fp8.quantize_rows`` (round to nearest, ties to even)."""
    x32 = x.float()
    if per_tensor:  # no rows: the all-zero scale, as the kernel's
        amax = x32.abs().amax().reshape(1, 1) if x32.numel() else x32.new_zeros(1, 1)
    else:
        amax = x32.abs().amax(-1, keepdim=True)
    scales = amax.clamp(min=MIN_AMAX) / FP8_MAX
    return Fp8Rows((x32 / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8), scales)


def quantize_rows(x: torch.Tensor, per_tensor: bool = False) -> Fp8Rows:
    """(T, K) rows as ``Fp8Rows``: Triton on CUDA, else the torch reference."""
    if x.is_cuda:
        from xgr.kernels.triton_fp8 import quantize_rows as kernel

        return Fp8Rows(*kernel(x, per_tensor))
    return quantize_rows_reference(x, per_tensor)


def quantize_weight(weight: torch.Tensor, per_channel: bool = True):
    """A weight in e4m3 with float32 scales, W ~= values * scales[:, None].

    Args:
        weight: (N, K) any float dtype.
        per_channel: one scale per output row; False: one for the whole tensor.

    Returns:
        (values (N, K) float8_e4m3fn, scales (N,) float32, or (1,) per tensor).
    """
    w32 = weight.detach().float()
    amax = w32.abs().amax(-1) if per_channel else w32.abs().amax().reshape(1)
    scales = amax.clamp(min=MIN_AMAX) / FP8_MAX
    values = (w32 / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return values, scales.contiguous()


def fp8_linear_reference(
    rows: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The FP8 projection in float32 arithmetic on dequantized factors, rounded to
    ``FP8_OUT_DTYPE``; arguments as ``fp8_linear``."""
    w = weight.float() * weight_scale[:, None]
    out = rows.dequantize() @ w.T
    if bias is not None:
        out = out + bias.float()
    return out.to(FP8_OUT_DTYPE)


def fp8_linear(
    rows: Fp8Rows, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """rows @ weight^T (+ bias) with both factors in e4m3.

    Args:
        rows: (T, K) quantized activations, per row or per tensor.
        weight: (N, K) float8_e4m3fn, contiguous.
        weight_scale: (N,) float32, or (1,) per tensor.
        bias: (N,) bf16 or None.

    Returns:
        (T, N) bf16. On CUDA ``torch._scaled_mm`` (float32 accumulation): per-tensor scaling
        when both scales are per tensor, else row-wise (a per-tensor scale repeated);
        elsewhere ``fp8_linear_reference``.
    """
    if not rows.values.is_cuda:
        return fp8_linear_reference(rows, weight, weight_scale, bias)
    scale_a, scale_b = rows.scales, weight_scale.view(1, -1)
    if scale_a.numel() != 1 or scale_b.numel() != 1:
        scale_a = scale_a.expand(rows.values.shape[0], 1).contiguous()
        scale_b = scale_b.expand(1, weight.shape[0]).contiguous()
    return torch._scaled_mm(
        rows.values, weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias,
        out_dtype=FP8_OUT_DTYPE,
    )  # fmt: skip


class Fp8Linear(nn.Module):
    """An ``nn.Linear`` without its bf16 weight: (T, K) -> (T, N) bf16 through ``fp8_linear``.

    Takes ``Fp8Rows`` (written quantized by the pass before) or plain (T, K) rows, which it
    quantizes first (``quantize_rows``, per tensor when its weight is). Buffers: ``weight``
    (N, K) float8_e4m3fn, ``weight_scale`` (N,) float32 or (1,) per tensor, ``bias`` (N,)
    bf16 or None.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias=None) -> None:
        super().__init__()
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(FP8_OUT_DTYPE))
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.per_tensor = weight_scale.numel() == 1

    @classmethod
    def from_linear(cls, linear: nn.Linear, per_channel: bool = True) -> Fp8Linear:
        """``linear`` quantized (``quantize_weight``); its bias kept in bf16.

        Raises:
            XgrError: input or output sizes that are not multiples of 16 (the FP8 GEMM's
                alignment).
        """
        out_features, in_features = linear.weight.shape
        if in_features % 16 or out_features % 16:
            raise XgrError(
                f"FP8 projections need sizes that are multiples of 16, got a "
                f"{in_features} -> {out_features} projection"
            )
        values, scales = quantize_weight(linear.weight, per_channel)
        return cls(values, scales, None if linear.bias is None else linear.bias.detach())

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        rows = x if isinstance(x, Fp8Rows) else quantize_rows(x, self.per_tensor)
        return fp8_linear(rows, self.weight, self.weight_scale, self.bias)


class Fp8RMSNorm(RMSNorm):
    """RMSNorm whose output is ``Fp8Rows`` (the next projection's FP8 input, per row or, with
    ``per_tensor``, per tensor), in Triton on CUDA (``xgr.kernels.triton_fp8.rms_norm_fp8``);
    input (T, dim) in the model dtype."""

    per_tensor = False

    @classmethod
    def from_norm(cls, norm: RMSNorm, per_tensor: bool = False) -> Fp8RMSNorm:
        out = cls(norm.weight.shape[0], norm.eps)
        out.weight, out.per_tensor = norm.weight, per_tensor
        return out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Fp8Rows of norm(x); with ``residual``, (x + residual, Fp8Rows of its norm)."""
        if x.is_cuda:
            from xgr.kernels.triton_fp8 import rms_norm_fp8

            out = rms_norm_fp8(x, self.weight, self.eps, residual, self.per_tensor)
            if residual is None:
                return Fp8Rows(*out)
            return out[0], Fp8Rows(*out[1])
        total = x if residual is None else x + residual
        rows = quantize_rows_reference(
            rms_norm_reference(total, self.weight, self.eps), self.per_tensor
        )
        return rows if residual is None else (total, rows)


class Fp8GatedMLP(nn.Module):
    """``xgr.layers.mlp.GatedMLP`` with FP8 projections: (T, hidden) rows (or ``Fp8Rows``) ->
    (T, hidden) bf16; act(gate) * up is written quantized for the down projection, per tensor
    when its weight is (``xgr.kernels.triton_fp8.gated_mul_fp8`` on CUDA)."""

    def __init__(
        self, gate_up_proj: Fp8Linear, down_proj: Fp8Linear, act: Callable, kernel_act: str | None
    ) -> None:
        super().__init__()
        self.gate_up_proj, self.down_proj = gate_up_proj, down_proj
        self.act, self.kernel_act = act, kernel_act

    def fuse_projections(self) -> None:
        """Already fused (built from a fused ``GatedMLP``): nothing to do."""

    def forward(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        projected = self.gate_up_proj(x)  # (T, 2 I), gate and up interleaved
        if projected.is_cuda and self.kernel_act is not None:
            from xgr.kernels.triton_fp8 import gated_mul_fp8

            rows = Fp8Rows(*gated_mul_fp8(projected, self.kernel_act, self.down_proj.per_tensor))
        else:
            rows = quantize_rows_reference(
                self.act(projected[:, 0::2]) * projected[:, 1::2], self.down_proj.per_tensor
            )
        return self.down_proj(rows)
