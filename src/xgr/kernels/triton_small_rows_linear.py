"""Triton projection for a handful of rows (at most 16), with a layer's elementwise work
fused in.

An encoder-decoder's first decode step has one row per request. Its projections are then
matrix-vector products, bound by reading the weights, and cuBLAS runs each as one or two kernels
of a few microseconds around RMSNorm, activation and residual-add passes of their own, so
launches, not bytes, set the step's time. Here one launch reads each weight once, spread over
enough programs to keep the memory system busy (a single row skips the tensor cores, whose
16-row tiles would set the narrowest column block, for 4-column blocks), and does its
neighbours' elementwise work:

- ``norm``: RMSNorm of the input rows (Zhang & Sennrich, 2019), the rows' mean squares
  taken in a first pass, the scale applied to each loaded tile;
- ``activation``: ReLU, SiLU or tanh-approximated GELU of the projection, or, ``gated``,
  act(gate) * up with the gate and up rows interleaved in one weight
  (``xgr.layers.linear.interleave_gate_up``; Shazeer, "GLU Variants Improve Transformer",
  2020);
- ``residual``: added last.

Each step rounds where the torch ops it replaces (``small_rows_linear_reference``) round:
the normalized rows, the scaled rows, the projection, the activation, each in the model
dtype. Only the GEMM's accumulation order and float32 rounding (rsqrt, exp) differ.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from xgr.kernels.triton_elementwise import (
    GELU_TANH,
    RELU,
    SILU,
    TORCH_ACTIVATIONS,
    activation,
)

MAX_ROWS = 16
# One row (a matrix-vector product in the FMA units, no tensor-core tile): 4-column blocks
# and 1024-wide K tiles, 8 warps, 2 stages: four times the programs of the tensor-core path's
# 16-column blocks, which made every T5 level-0 projection faster (docs/performance.md).
ONE_ROW_LAUNCH = (4, 1024, 8, 2)
ACTIVATIONS = {None: 0, "relu": RELU, "gelu_tanh": GELU_TANH, "silu": SILU}


@triton.jit
def _accumulate(a, w, acc, ROWS_BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    """acc + a @ w.T for (ROWS_BLOCK, K) rows a and an (N, K) weight tile w: a tensor-core
    dot for 16 rows; for one row products and sums in float32, as the dot's."""
    if ROWS_BLOCK == 1:
        return acc + tl.sum(w.to(tl.float32) * a.to(tl.float32), 1)[None, :]
    return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def _small_rows_linear_kernel(
    X, W, OUT, NORM_W, RES, rows, cols, stride_x, stride_w, stride_o, stride_r, eps,
    depth: tl.constexpr, NORM: tl.constexpr, RESIDUAL: tl.constexpr, ACT: tl.constexpr,
    GATED: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ROWS_BLOCK: tl.constexpr,
):  # fmt: skip
    """Grid: (column blocks,); every program holds all rows, so each weight tile is read
    once. ``depth`` (K) is a compile-time constant: a model has a few. ROWS_BLOCK 16: the
    rows are one tensor-core tile; 1: one row, a matrix-vector product in the FMA units,
    which takes column blocks narrower than a tensor-core tile (more programs in flight
    for the narrow projections)."""
    dtype = OUT.dtype.element_ty
    r = tl.arange(0, ROWS_BLOCK)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    r_ok, n_ok = r < rows, n < cols
    kk = tl.arange(0, BLOCK_K)
    x_rows = X + r[:, None] * stride_x
    if NORM:
        squares = tl.zeros([ROWS_BLOCK], tl.float32)
        for k in tl.static_range(0, depth, BLOCK_K):  # unrolled: the loads overlap
            ok = r_ok[:, None] & (k + kk < depth)[None, :]
            xs = tl.load(x_rows + (k + kk)[None, :], mask=ok, other=0.0).to(tl.float32)
            squares += tl.sum(xs * xs, 1)
        rstd = 1.0 / tl.sqrt(squares / depth + eps)
    acc = tl.zeros([ROWS_BLOCK, BLOCK_N], tl.float32)
    if GATED:
        acc_up = tl.zeros([ROWS_BLOCK, BLOCK_N], tl.float32)
    if GATED:  # gate row 2 n, up row 2 n + 1
        w_rows = W + (2 * n)[:, None].to(tl.int64) * stride_w
        w_up = w_rows + stride_w
    else:
        w_rows = W + n[:, None].to(tl.int64) * stride_w
        w_up = w_rows
    for k in range(0, depth, BLOCK_K):
        k_ok = k + kk < depth
        a = tl.load(x_rows + (k + kk)[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:  # the reference's two roundings: normalized rows, then times the scale
            g = tl.load(NORM_W + k + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = (a.to(tl.float32) * rstd[:, None]).to(dtype).to(tl.float32) * g[None, :]
            a = a.to(dtype)
        w_ok = n_ok[:, None] & k_ok[None, :]
        w = tl.load(w_rows + (k + kk)[None, :], mask=w_ok, other=0.0)
        acc = _accumulate(a, w, acc, ROWS_BLOCK, PRECISION)
        if GATED:
            w = tl.load(w_up + (k + kk)[None, :], mask=w_ok, other=0.0)
            acc_up = _accumulate(a, w, acc_up, ROWS_BLOCK, PRECISION)
    out = acc.to(dtype).to(tl.float32)  # the projection, rounded as the reference stores it
    if ACT != 0:
        out = activation(out, ACT).to(dtype).to(tl.float32)
    if GATED:
        out = (out * acc_up.to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    ok = r_ok[:, None] & n_ok[None, :]
    if RESIDUAL:
        out += tl.load(RES + r[:, None] * stride_r + n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + r[:, None] * stride_o + n[None, :], out.to(dtype), mask=ok)


def launch_config(cols: int, rows: int = MAX_ROWS) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for ``rows`` rows of ``cols`` outputs.

    Several rows: 16-column blocks, so that even a 1024-column projection spreads over most
    of the GPU's SMs, and 256-wide K tiles (fewer for a smaller K, at least 16): the fastest
    of the launches swept for one and eight rows of the T5 projections, within the spread
    between runs (docs/performance.md). One row: ``ONE_ROW_LAUNCH``."""
    return ONE_ROW_LAUNCH if rows == 1 else (16, 256, 4, 3)


def small_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    gated: bool = False,
    config: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``small_rows_linear_reference`` in one Triton launch.

    Args:
        x: (M, K) rows, M <= ``MAX_ROWS``, last dimension contiguous; float32, float16 or
            bfloat16.
        weight: (N, K) an ``nn.Linear`` weight (no bias) in x's dtype, last dimension
            contiguous; gated: N = 2 I, rows interleaved (gate 0, up 0, gate 1, ...).
        norm_weight: (K,) RMSNorm scale applied to x first (x's dtype), or None.
        eps: the norm's epsilon.
        residual: (M, N) (or (M, I) gated) added last, in x's dtype, or None.
        activation: None, "relu", "gelu_tanh" or "silu".
        gated: the output is act(gate) * up (needs an activation).
        config: ``launch_config``'s tuple, to override it (benchmarks).

    Returns:
        (M, N), or (M, I) gated, in x's dtype.

    Raises:
        ValueError: too many rows, no columns, another dtype, mismatched shapes, dtypes or
            devices, an odd gated weight, a non-contiguous last dimension, an unknown
            activation, or a ``config`` with column blocks under 16 for several rows.
    """
    if x.dim() != 2 or x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(
            f"x must be (M, K) float32/float16/bfloat16, got {tuple(x.shape)} {x.dtype}"
        )
    rows, depth = x.shape
    if depth < 1:
        raise ValueError("x needs at least one column")
    if rows > MAX_ROWS:
        raise ValueError(f"at most {MAX_ROWS} rows, got {rows}")
    if weight.dim() != 2 or weight.shape[1] != depth or weight.dtype != x.dtype:
        raise ValueError(f"weight must be (N, {depth}) {x.dtype}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")  # fmt: skip
    if activation not in ACTIVATIONS or (gated and (activation is None or weight.shape[0] % 2)):
        raise ValueError(f"activation must be one of {list(ACTIVATIONS)} (not None when gated, "
                         f"over an even number of rows), got {activation!r}")  # fmt: skip
    cols = weight.shape[0] // 2 if gated else weight.shape[0]
    if depth > 1 and (x.stride(1) != 1 or weight.stride(1) != 1):
        raise ValueError("x and weight need a contiguous last dimension")
    if any(t is not None and t.device != x.device for t in (weight, norm_weight, residual)):
        raise ValueError(f"weight, norm_weight and residual must be on x's device {x.device}")
    for name, t, shape in (("norm_weight", norm_weight, (depth,)),
                           ("residual", residual, (rows, cols))):  # fmt: skip
        if t is not None and (
            tuple(t.shape) != shape or t.dtype != x.dtype or (shape[-1] > 1 and t.stride(-1) != 1)
        ):
            raise ValueError(f"{name} must be {shape} {x.dtype}, contiguous, got "
                             f"{tuple(t.shape)} {t.dtype}")  # fmt: skip
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if not rows or not cols:
        return out
    block_n, block_k, warps, stages = config or launch_config(cols, rows)
    if rows > 1 and block_n < 16:  # the interpreter would run it; a GPU compile fails
        raise ValueError(f"config: rows > 1 run on tensor-core tiles of >= 16 columns, got "
                         f"BLOCK_N {block_n}")  # fmt: skip
    _small_rows_linear_kernel[(triton.cdiv(cols, block_n),)](
        x, weight, out, norm_weight if norm_weight is not None else x,
        residual if residual is not None else x,
        rows, cols, x.stride(0), weight.stride(0), out.stride(0),
        residual.stride(0) if residual is not None else 0, eps,
        depth=depth, NORM=norm_weight is not None, RESIDUAL=residual is not None,
        ACT=ACTIVATIONS[activation], GATED=gated,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        # tl.dot needs K tiles of at least 16 on NVIDIA GPUs (the interpreter takes fewer).
        BLOCK_N=block_n, BLOCK_K=max(16, min(block_k, triton.next_power_of_2(depth))),
        ROWS_BLOCK=1 if rows == 1 else 16, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def small_rows_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    gated: bool = False,
) -> torch.Tensor:
    """The torch ops ``small_rows_linear`` replaces: [residual +] act(F.linear(rms_norm(x),
    weight)) [* up]. Arguments, shapes and result as ``small_rows_linear``."""
    if norm_weight is not None:  # xgr.layers.norm.rms_norm_reference, HF's rounding
        x32 = x.float()
        x = norm_weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = F.linear(x, weight)
    up = None
    if gated:
        out, up = out[:, 0::2], out[:, 1::2]
    if activation is not None:
        out = TORCH_ACTIVATIONS[activation](out)
    if up is not None:
        out = out * up
    return out if residual is None else residual + out
