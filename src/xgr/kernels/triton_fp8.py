"""Triton passes that write their rows in FP8 (e4m3) for the next projection's FP8 GEMM.

An FP8 GEMM (``torch._scaled_mm``) reads e4m3 activations with one float32 scale per row.
Quantizing them in a pass of their own (amax, scale, cast) costs a launch and a round trip
through memory per projection, more at decode row counts than the FP8 GEMM saves, so the
passes that produce a projection's input quantize it as they write it:

- ``rms_norm_fp8``: RMSNorm (with the residual add) writes e4m3 rows (the q/k/v and gate/up
  projections' inputs);
- ``gated_mul_fp8``: act(gate) * up writes e4m3 rows (the down projection's input);
- ``quantize_rows``: any rows (the attention output, the output projection's input).

Scales are dynamic, one per token row: scale = max(amax, ``MIN_AMAX``) / 448, the row's
largest magnitude mapping to e4m3's largest finite value. A row holds one token's features,
all in one program, so its amax needs no second pass, and a token with large activations
(the outliers of trained LLMs) costs only its own row's resolution; static per-tensor scales
would need calibration data and clip such tokens. Every value is rounded to the model dtype
first, where the torch references (``xgr.layers.fp8``) round, then divided (IEEE division)
and rounded to nearest e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgr.kernels.triton_elementwise import (
    FP8_MAX,
    GATE_ACTIVATIONS,
    activation,
    launch_rms_norm,
    quantize_tile,
    rms_norm_rows,
    rows_per_program,
)

FP8 = torch.float8_e4m3fn
HALF_DTYPES = (torch.bfloat16, torch.float16)


def _fp8_rows(rows: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (rows, dim) e4m3 values and (rows, 1) float32 scales."""
    return (
        torch.empty(rows, dim, dtype=FP8, device=device),
        torch.empty(rows, 1, dtype=torch.float32, device=device),
    )


def _num_warps(width: int) -> int:
    return 4 if width <= 2048 else 8 if width <= 8192 else 16


@triton.jit
def _quantize_rows_kernel(
    X, Q, SCALES, rows, dim, stride_x, stride_q, FP8_MAX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (offs < dim)[None, :]
    x = tl.load(X + r[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    quantize_tile(x.to(tl.float32), Q, SCALES, r, offs, ok, rows, stride_q, FP8_MAX)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` as e4m3 with its own scale, in one pass.

    Args:
        x: (T, K) float32, float16 or bfloat16, last dimension contiguous.

    Returns:
        (values (T, K) float8_e4m3fn, scales (T, 1) float32), x ~= values * scales.

    Raises:
        ValueError: not 2-D, another dtype, no columns, or a non-contiguous last dimension.
    """
    if x.dim() != 2 or x.dtype not in (torch.float32, *HALF_DTYPES) or x.shape[1] < 1:
        raise ValueError(f"x must be (T, K >= 1) float32/float16/bfloat16, got "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError("x needs a contiguous last dimension")
    rows, dim = x.shape
    values, scales = _fp8_rows(rows, dim, x.device)
    block_m = rows_per_program(dim)
    if rows:
        _quantize_rows_kernel[(triton.cdiv(rows, block_m),)](
            x, values, scales, rows, dim, x.stride(0), values.stride(0), FP8_MAX=FP8_MAX,
            BLOCK_M=block_m, BLOCK=triton.next_power_of_2(dim), num_warps=_num_warps(dim),
        )  # fmt: skip
    return values, scales


def rms_norm_fp8(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
):
    """``xgr.kernels.triton_elementwise.rms_norm`` writing its rows as e4m3 (``quantize_rows``
    of the normalized rows, rounded to x's dtype first), in the same one pass.

    Args:
        x: (T, dim) or (..., dim) fp32/fp16/bf16, last dimension contiguous.
        weight: (dim,) the norm's scale, in x's dtype.
        eps: added to the mean square.
        residual: optional tensor of x's shape added to x first.

    Returns:
        (values (T, dim) float8_e4m3fn, scales (T, 1) float32), T the rows of x; with
        residual, (x + residual in x's shape and dtype, (values, scales)).

    Raises:
        ValueError: as ``rms_norm``.
    """
    x2, delta, weight = rms_norm_rows(x, weight, residual)
    values, scales = _fp8_rows(*x2.shape, x.device)
    total = values if delta is None else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    launch_rms_norm(
        x2, x2 if delta is None else delta, weight, values, total, scales, eps, delta is not None
    )
    if residual is None:
        return values, scales
    return total.view(x.shape), (values, scales)


@triton.jit
def _gated_mul_fp8_kernel(
    GU, Q, SCALES, rows, inter, stride_gu, stride_q, ACT: tl.constexpr,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (offs < inter)[None, :]
    # (gate, up) pairs side by side: (BLOCK_M, BLOCK, 2)
    pairs = r[:, None, None] * stride_gu + offs[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]
    gu = tl.load(GU + pairs, mask=ok[:, :, None], other=0.0).to(tl.float32)
    g, u = gu.split()
    dtype = GU.dtype.element_ty
    act = activation(g, ACT).to(dtype).to(tl.float32)
    out = (act * u).to(dtype).to(tl.float32)
    quantize_tile(out, Q, SCALES, r, offs, ok, rows, stride_q, FP8_MAX)


def gated_mul_fp8(gate_up: torch.Tensor, act: str = "silu") -> tuple[torch.Tensor, torch.Tensor]:
    """``xgr.kernels.triton_elementwise.gated_mul_interleaved`` writing its rows as e4m3:
    act(gate) * up rounded to gate_up's dtype, then ``quantize_rows``, in one pass (a whole
    row in one program, for its amax).

    Args:
        gate_up: (T, 2 I) fp32/fp16/bf16, columns gate 0, up 0, gate 1, up 1, ...; last
            dimension contiguous.
        act: "silu" or "gelu_tanh".

    Returns:
        (values (T, I) float8_e4m3fn, scales (T, 1) float32).

    Raises:
        ValueError: not 2-D floats of those dtypes, an odd or zero number of columns, a
            non-contiguous last dimension, or another activation.
    """
    if act not in GATE_ACTIVATIONS:
        raise ValueError(f"act must be one of {list(GATE_ACTIVATIONS)}, got {act!r}")
    if (
        gate_up.dim() != 2
        or gate_up.shape[1] % 2
        or gate_up.shape[1] < 2
        or gate_up.dtype not in (torch.float32, *HALF_DTYPES)
    ):
        raise ValueError(f"gate_up must be (T, 2 I >= 2) float32/float16/bfloat16, got "
                         f"{tuple(gate_up.shape)} {gate_up.dtype}")  # fmt: skip
    if gate_up.stride(-1) != 1:
        raise ValueError("gate_up needs a contiguous last dimension")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    values, scales = _fp8_rows(rows, inter, gate_up.device)
    block = triton.next_power_of_2(inter)
    block_m = rows_per_program(2 * inter)
    if rows:
        _gated_mul_fp8_kernel[(triton.cdiv(rows, block_m),)](
            gate_up, values, scales, rows, inter, gate_up.stride(0), values.stride(0),
            ACT=GATE_ACTIVATIONS[act], FP8_MAX=FP8_MAX, BLOCK_M=block_m, BLOCK=block,
            num_warps=_num_warps(2 * inter),
        )  # fmt: skip
    return values, scales
