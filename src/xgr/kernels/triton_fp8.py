"""Triton passes that write their rows in FP8 (e4m3) for the next projection's FP8 GEMM.

An FP8 GEMM (``torch._scaled_mm``) reads e4m3 activations with one float32 scale per row.
Quantizing them in a pass of their own (amax, scale, cast) costs a launch and a round trip
through memory per projection, more at decode row counts than the FP8 GEMM saves, so the
passes that produce a projection's input quantize it as they write it:

- ``rms_norm_fp8``: RMSNorm (with the residual add) writes e4m3 rows (the q/k/v and gate/up
  projections' inputs);
- ``gated_mul_fp8``: act(gate) * up writes e4m3 rows (the down projection's input);
- ``quantize_rows``: any rows (the attention output, the output projection's input).

Scales are dynamic, computed from the rows being written: scale = max(amax, ``MIN_AMAX``) /
448, the largest magnitude mapping to e4m3's largest finite value, either

- per token row (``per_tensor=False``): a row is in one program, so one launch, and a token
  with large activations (the outliers of trained LLMs) costs only its own row's resolution;
  the GEMM then needs row-wise scaling; or
- per tensor (``per_tensor=True``): the GEMM runs at cuBLAS's per-tensor FP8 rate, but the
  amax of all rows is needed before any row is written, so the pass runs twice: the first
  launch reduces the amax (an atomic max per program), the second recomputes its rows and
  writes them. Static (calibrated) scales would save that launch but need calibration data
  and clip the activations they did not see.

Every value is rounded to the model dtype first, where the torch references
(``xgr.layers.fp8``) round, then divided (IEEE division) and rounded to nearest e4m3.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgr.kernels.triton_elementwise import (
    FP8_MAX,
    GATE_ACTIVATIONS,
    QUANT_AMAX,
    QUANT_ROWS,
    QUANT_TENSOR,
    activation,
    launch_rms_norm,
    rms_norm_rows,
    rows_per_program,
    store_quantized,
)

FP8 = torch.float8_e4m3fn
HALF_DTYPES = (torch.bfloat16, torch.float16)


# e4m3's scale for all-zero rows (``xgr.layers.fp8.MIN_AMAX`` / 448).
_ZERO_SCALE = 1e-12 / FP8_MAX


def _fp8_rows(rows: int, dim: int, device, per_tensor: bool):
    """Empty (rows, dim) e4m3 values and float32 scales, (rows, 1) or, per tensor, (1, 1)
    (already that of zero rows, for the case of no rows)."""
    values = torch.empty(rows, dim, dtype=FP8, device=device)
    if per_tensor:
        return values, torch.full((1, 1), _ZERO_SCALE, dtype=torch.float32, device=device)
    return values, torch.empty(rows, 1, dtype=torch.float32, device=device)


def _launches(per_tensor: bool, device):
    """The (quant mode, amax buffer) of each launch of a quantizing pass: one launch per row,
    or two per tensor sharing one zeroed float32 amax."""
    if not per_tensor:
        return [(QUANT_ROWS, None)]
    amax = torch.zeros(1, dtype=torch.float32, device=device)
    return [(QUANT_AMAX, amax), (QUANT_TENSOR, amax)]


def _num_warps(width: int) -> int:
    return 4 if width <= 2048 else 8 if width <= 8192 else 16


@triton.jit
def _quantize_rows_kernel(
    X, Q, SCALES, AMAX, rows, dim, stride_x, stride_q, QUANT: tl.constexpr,
    FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (offs < dim)[None, :]
    x = tl.load(X + r[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    store_quantized(x.to(tl.float32), Q, SCALES, AMAX, r, offs, ok, rows, stride_q, QUANT,
                    FP8_MAX)  # fmt: skip


def quantize_rows(x: torch.Tensor, per_tensor: bool = False):
    """``x`` as e4m3, each row with its own scale (one pass) or all with one (two).

    Args:
        x: (T, K) float32, float16 or bfloat16, last dimension contiguous.
        per_tensor: one scale for the whole tensor.

    Returns:
        (values (T, K) float8_e4m3fn, scales (T, 1) float32, or (1, 1) per tensor),
        x ~= values * scales.

    Raises:
        ValueError: not 2-D, another dtype, no columns, or a non-contiguous last dimension.
    """
    if x.dim() != 2 or x.dtype not in (torch.float32, *HALF_DTYPES) or x.shape[1] < 1:
        raise ValueError(f"x must be (T, K >= 1) float32/float16/bfloat16, got "
                         f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
    if x.stride(1) != 1 and x.shape[1] > 1:
        raise ValueError("x needs a contiguous last dimension")
    rows, dim = x.shape
    values, scales = _fp8_rows(rows, dim, x.device, per_tensor)
    block_m = rows_per_program(dim)
    for quant, amax in _launches(per_tensor, x.device) if rows else ():
        _quantize_rows_kernel[(triton.cdiv(rows, block_m),)](
            x, values, scales, scales if amax is None else amax, rows, dim, x.stride(0),
            values.stride(0), QUANT=quant, FP8_MAX=FP8_MAX, BLOCK_M=block_m,
            BLOCK=triton.next_power_of_2(dim), num_warps=_num_warps(dim),
        )  # fmt: skip
    return values, scales


def rms_norm_fp8(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    per_tensor: bool = False,
):
    """``xgr.kernels.triton_elementwise.rms_norm`` writing its rows as e4m3 (``quantize_rows``
    of the normalized rows, rounded to x's dtype first) in the same pass (run twice per
    tensor: the second launch reads the first's sum instead of adding again).

    Args:
        x: (T, dim) or (..., dim) fp32/fp16/bf16, last dimension contiguous.
        weight: (dim,) the norm's scale, in x's dtype.
        eps: added to the mean square.
        residual: optional tensor of x's shape added to x first.
        per_tensor: one scale for all rows.

    Returns:
        (values (T, dim) float8_e4m3fn, scales (T, 1) float32, or (1, 1) per tensor), T the
        rows of x; with residual, (x + residual in x's shape and dtype, (values, scales)).

    Raises:
        ValueError: as ``rms_norm``.
    """
    x2, delta, weight = rms_norm_rows(x, weight, residual)
    values, scales = _fp8_rows(*x2.shape, x.device, per_tensor)
    total = values if delta is None else torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    for quant, amax in _launches(per_tensor, x.device):
        add = delta is not None and quant != QUANT_TENSOR
        source = total if delta is not None and not add else x2
        launch_rms_norm(source, delta if add else source, weight, values, total, eps, add,
                        scales, amax, quant)  # fmt: skip
    if residual is None:
        return values, scales
    return total.view(x.shape), (values, scales)


@triton.jit
def _gated_mul_fp8_kernel(
    GU, Q, SCALES, AMAX, rows, inter, stride_gu, stride_q, ACT: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
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
    store_quantized(out, Q, SCALES, AMAX, r, offs, ok, rows, stride_q, QUANT, FP8_MAX)


def gated_mul_fp8(gate_up: torch.Tensor, act: str = "silu", per_tensor: bool = False):
    """``xgr.kernels.triton_elementwise.gated_mul_interleaved`` writing its rows as e4m3:
    act(gate) * up rounded to gate_up's dtype, then ``quantize_rows``, in one pass (a whole
    row in one program, for its amax; two passes per tensor).

    Args:
        gate_up: (T, 2 I) fp32/fp16/bf16, columns gate 0, up 0, gate 1, up 1, ...; last
            dimension contiguous.
        act: "silu" or "gelu_tanh".
        per_tensor: one scale for all rows.

    Returns:
        (values (T, I) float8_e4m3fn, scales (T, 1) float32, or (1, 1) per tensor).

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
    values, scales = _fp8_rows(rows, inter, gate_up.device, per_tensor)
    block = triton.next_power_of_2(inter)
    block_m = rows_per_program(2 * inter)
    for quant, amax in _launches(per_tensor, gate_up.device) if rows else ():
        _gated_mul_fp8_kernel[(triton.cdiv(rows, block_m),)](
            gate_up, values, scales, scales if amax is None else amax, rows, inter,
            gate_up.stride(0), values.stride(0), ACT=GATE_ACTIVATIONS[act], QUANT=quant,
            FP8_MAX=FP8_MAX, BLOCK_M=block_m, BLOCK=block, num_warps=_num_warps(2 * inter),
        )  # fmt: skip
    return values, scales
