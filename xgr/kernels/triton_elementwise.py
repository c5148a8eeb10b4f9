"""Triton kernels for the per-token elementwise work of a decoder layer.

Eager PyTorch runs RMSNorm as six kernels, RoPE as five and the gated activation as two,
each a pass over memory and, inside a CUDA graph, a node of a few microseconds: at decode
(hundreds of rows) these launches, not the arithmetic, set a layer's time. Each kernel here
does one pass. They reproduce the torch references (``xgr.layers``) rounding step by step
(float32 arithmetic, rounded to the model dtype where the reference rounds), so they differ
from them only by float32 rounding (rsqrt vs 1/sqrt, exp, fused multiply-adds), which in
bf16/fp16 rarely changes the rounded result.

References: RMSNorm (Zhang & Sennrich, 2019); RoPE in the half-split layout (Su et al.,
"RoFormer", 2021); SiLU-gated feed-forward (Shazeer, "GLU Variants Improve Transformer", 2020).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements one program of a row-wise kernel handles: rows are tiled until a tile holds this
# many, so short rows (a 128-wide head in q/k norm and RoPE) do not leave programs idle.
TILE_ELEMENTS = 4096


def _rows_per_program(width: int) -> int:
    return max(1, TILE_ELEMENTS // triton.next_power_of_2(width))


@triton.jit
def _rms_norm_kernel(
    X, DELTA, W, OUT, SUM, rows, stride_x, stride_d, stride_o, stride_s, dim, eps,
    ADD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (offs < dim)[None, :]
    x = tl.load(X + r[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    if ADD:  # residual add, rounded to the model dtype as the reference's ``x + delta``
        x = x + tl.load(DELTA + r[:, None] * stride_d + offs[None, :], mask=ok, other=0.0)
        tl.store(SUM + r[:, None] * stride_s + offs[None, :], x, mask=ok)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / dim + eps)
    y = (x32 * rstd[:, None]).to(OUT.dtype.element_ty)
    w = tl.load(W + offs, mask=offs < dim, other=0.0)
    out = y.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(OUT + r[:, None] * stride_o + offs[None, :], out.to(OUT.dtype.element_ty), mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension, optionally after a residual add, in one pass.

    Args:
        x: (..., dim) fp32/fp16/bf16, last dimension contiguous.
        weight: (dim,) the norm's scale, in x's dtype.
        eps: added to the mean square.
        residual: optional (..., dim) tensor added to x first.

    Returns:
        norm(x) in x's dtype; with residual, (x + residual, norm(x + residual)).

    Raises:
        ValueError: mismatched shapes, dtypes, or a non-contiguous last dimension.
    """
    dim = x.shape[-1]
    if dim == 0:
        raise ValueError("rms_norm needs a last dimension of at least 1")
    if weight.shape != (dim,) or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be ({dim},) {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    weight = weight.contiguous()
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        raise ValueError("the last dimension must be contiguous")
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if residual is None:
        delta, total = x2, out  # unused by the kernel
    else:
        delta = residual.reshape(-1, dim)
        if delta.stride(-1) != 1:
            raise ValueError("the last dimension must be contiguous")
        total = torch.empty_like(out)
    rows = x2.shape[0]
    block_m = _rows_per_program(dim)
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, block_m),)](
            x2, delta, weight, out, total, rows,
            x2.stride(0), delta.stride(0), out.stride(0), total.stride(0), dim, eps,
            ADD=residual is not None, BLOCK_M=block_m, BLOCK=triton.next_power_of_2(dim),
            num_warps=4 if dim <= 2048 else 8,
        )  # fmt: skip
    out = out.view(x.shape)
    return out if residual is None else (total.view(x.shape), out)


@triton.jit
def _gated_mul_kernel(
    G, U, OUT, stride_g, stride_u, stride_o, inter, GELU: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(G + row * stride_g + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + offs, mask=ok, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    if GELU:  # tanh approximation (HF's gelu_new): 0.5 g (1 + tanh(sqrt(2 / pi) (g + c g^3)))
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        # 0.5 (1 + tanh z) = 1 / (1 + exp(-2 z)); this form keeps the negative tail (no
        # cancellation of 1 - 1 / (1 + exp(2 z)) to 0).
        act = (g / (1.0 + tl.exp(-2.0 * z))).to(dtype)
    else:
        act = (g / (1.0 + tl.exp(-g))).to(dtype)  # F.silu rounds here
    tl.store(OUT + row * stride_o + offs, (act.to(tl.float32) * u).to(dtype), mask=ok)


def _gated_mul(gate: torch.Tensor, up: torch.Tensor, gelu: bool) -> torch.Tensor:
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.dim() != 2:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must match (T, I)")
    if gate.stride(-1) != 1 or up.stride(-1) != 1:
        raise ValueError("gate and up need a contiguous last dimension")
    rows, inter = gate.shape
    out = torch.empty(rows, inter, dtype=gate.dtype, device=gate.device)
    block = min(1024, triton.next_power_of_2(inter))
    if rows:
        _gated_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate, up, out, gate.stride(0), up.stride(0), out.stride(0), inter,
            GELU=gelu, BLOCK=block,
        )  # fmt: skip
    return out


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in one pass (the SwiGLU feed-forward of Qwen / Llama).

    Args:
        gate, up: (T, I) of one dtype, last dimension contiguous.

    Returns:
        (T, I) in the inputs' dtype.

    Raises:
        ValueError: mismatched shapes or dtypes, or a non-contiguous last dimension.
    """
    return _gated_mul(gate, up, gelu=False)


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, approximate="tanh") * up in one pass (T5 v1.1's gated-GELU feed-forward).

    Arguments, result and errors as ``silu_mul``.
    """
    return _gated_mul(gate, up, gelu=True)


@triton.jit
def _rope_kernel(
    X, COS, SIN, OUT, rows, heads, stride_xt, stride_xh, stride_ct, stride_ot, stride_oh,
    HALF: tl.constexpr, BLOCK_M: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (token, head) rows
    ok = (r < rows)[:, None]
    t = (r // heads)[:, None]
    h = (r % heads)[:, None]
    offs = tl.arange(0, HALF)[None, :]
    x_ptr = X + t * stride_xt + h * stride_xh + offs
    lo = tl.load(x_ptr, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    c_ptr = COS + t * stride_ct + offs
    s_ptr = SIN + t * stride_ct + offs
    c_lo = tl.load(c_ptr, mask=ok, other=0.0).to(tl.float32)
    c_hi = tl.load(c_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    s_lo = tl.load(s_ptr, mask=ok, other=0.0).to(tl.float32)
    s_hi = tl.load(s_ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    dtype = OUT.dtype.element_ty
    # x * cos + rotate_half(x) * sin, each product rounded as the reference rounds it.
    out_lo = (lo * c_lo).to(dtype).to(tl.float32) + (-hi * s_lo).to(dtype).to(tl.float32)
    out_hi = (hi * c_hi).to(dtype).to(tl.float32) + (lo * s_hi).to(dtype).to(tl.float32)
    o_ptr = OUT + t * stride_ot + h * stride_oh + offs
    tl.store(o_ptr, out_lo.to(dtype), mask=ok)
    tl.store(o_ptr + HALF, out_hi.to(dtype), mask=ok)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (T, heads, head_dim) x by the (T, head_dim) tables of ``rope_cos_sin``.

    Returns:
        (T, heads, head_dim) contiguous, in x's dtype.

    Raises:
        ValueError: shapes that do not fit, an odd head_dim or one that is not a power of two.
    """
    tokens, heads, head_dim = x.shape
    half = head_dim // 2
    if (
        head_dim % 2
        or half & (half - 1)
        or cos.shape != (tokens, head_dim)
        or sin.shape != cos.shape
    ):
        raise ValueError(f"x {tuple(x.shape)} and tables {tuple(cos.shape)} do not fit")
    if x.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("x and the tables need a contiguous last dimension")
    if sin.stride() != cos.stride():
        raise ValueError(f"cos and sin need the same strides, got {cos.stride()}, {sin.stride()}")
    out = torch.empty(tokens, heads, head_dim, dtype=x.dtype, device=x.device)
    rows = tokens * heads
    block_m = _rows_per_program(head_dim)
    if rows:
        _rope_kernel[(triton.cdiv(rows, block_m),)](
            x, cos, sin, out, rows, heads, x.stride(0), x.stride(1), cos.stride(0),
            out.stride(0), out.stride(1), HALF=half, BLOCK_M=block_m, num_warps=4,
        )  # fmt: skip
    return out
