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
import torch.nn.functional as F
import triton
import triton.language as tl

# Elements one program of a row-wise kernel handles: rows are tiled until a tile holds this
# many, so short rows (a 128-wide head in q/k norm and RoPE) do not leave programs idle.
TILE_ELEMENTS = 4096


# The q/k/v pass's tile: 16 rows of 128 (4 warps) measured faster than 32 rows at both
# prefill and decode sizes (docs/performance.md).
QKV_TILE_ELEMENTS = 2048


def rows_per_program(width: int, tile_elements: int = TILE_ELEMENTS) -> int:
    return max(1, tile_elements // triton.next_power_of_2(width))


# What a row-wise pass writes (the ``QUANT`` constexpr of the kernels that quantize): rows
# in the model dtype; e4m3 rows, one scale each; only the tile's amax, atomically maxed into
# one float32 (the first of a per-tensor quantization's two launches); e4m3 rows with the
# one scale that amax gives (the second launch).
STORE, QUANT_ROWS, QUANT_AMAX, QUANT_TENSOR = 0, 1, 2, 3


@triton.jit
def _rms_norm_kernel(
    X, DELTA, W, OUT, SUM, SCALES, AMAX, rows, stride_x, stride_d, stride_o, stride_s, dim,
    eps, ADD: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs = tl.arange(0, BLOCK)
    ok = (r < rows)[:, None] & (offs < dim)[None, :]
    x = tl.load(X + r[:, None] * stride_x + offs[None, :], mask=ok, other=0.0)
    if ADD:  # residual add, rounded to the model dtype as the reference's ``x + delta``
        x = x + tl.load(DELTA + r[:, None] * stride_d + offs[None, :], mask=ok, other=0.0)
        tl.store(SUM + r[:, None] * stride_s + offs[None, :], x, mask=ok)
    dtype = X.dtype.element_ty
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, 1) / dim + eps)
    y = (x32 * rstd[:, None]).to(dtype)
    w = tl.load(W + offs, mask=offs < dim, other=0.0)
    out = (y.to(tl.float32) * w.to(tl.float32)[None, :]).to(dtype)
    if QUANT == 0:
        tl.store(OUT + r[:, None] * stride_o + offs[None, :], out, mask=ok)
    else:
        store_quantized(out.to(tl.float32), OUT, SCALES, AMAX, r, offs, ok, rows, stride_o,
                        QUANT, FP8_MAX)  # fmt: skip


@triton.jit
def store_quantized(
    y, Q, SCALES, AMAX, r, offs, ok, rows, stride_q, QUANT: tl.constexpr, FP8_MAX: tl.constexpr
):  # fmt: skip
    """Store float32 rows ``y`` (masked lanes 0) as e4m3, by ``QUANT``: one scale per row
    (``quantize_tile``), the tile's amax maxed into AMAX[0] (``QUANT_AMAX``), or with the
    one scale max(AMAX[0], 1e-12) / FP8_MAX, which the first program also stores in
    SCALES[0] (``QUANT_TENSOR``)."""
    if QUANT == 1:
        quantize_tile(y, Q, SCALES, r, offs, ok, rows, stride_q, FP8_MAX)
    elif QUANT == 2:
        tl.atomic_max(AMAX, tl.max(tl.max(tl.abs(y), 1), 0))
    else:
        scale = tl.maximum(tl.load(AMAX), 1e-12) / FP8_MAX  # xgr.layers.fp8.MIN_AMAX
        q = tl.div_rn(y, tl.full(y.shape, 0.0, tl.float32) + scale)
        q = round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
        tl.store(Q + r[:, None] * stride_q + offs[None, :], q.to(Q.dtype.element_ty), mask=ok)
        if tl.program_id(0) == 0:
            tl.store(SCALES, scale)


@triton.jit
def quantize_tile(y, Q, SCALES, r, offs, ok, rows, stride_q, FP8_MAX: tl.constexpr):
    """Store float32 rows ``y`` (masked lanes 0) as e4m3 with one float32 scale per row:
    scale = max(amax, 1e-12) / FP8_MAX, q = y / scale rounded to nearest (IEEE division,
    as torch divides), so the row's largest value maps to FP8_MAX."""
    amax = tl.max(tl.abs(y), 1)
    scale = tl.maximum(amax, 1e-12) / FP8_MAX  # xgr.layers.fp8.MIN_AMAX: all-zero rows
    q = tl.div_rn(y, tl.broadcast_to(scale[:, None], y.shape))
    q = round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
    tl.store(Q + r[:, None] * stride_q + offs[None, :], q.to(Q.dtype.element_ty), mask=ok)
    tl.store(SCALES + r, scale, mask=r < rows)


@triton.jit
def round_to_e4m3(q):
    """float32 q (|q| <= 448) rounded to the nearest e4m3 value, ties to even, in float32, so
    the cast that follows is exact: the same result on the GPU and under Triton's interpreter
    (whose own cast rounds wrongly where rounding up carries into the exponent). Normal
    values (|q| >= 2^-6) keep 3 of float32's 23 mantissa bits; smaller ones round to a
    multiple of e4m3's subnormal step 2^-9 (adding and subtracting 1.5 * 2^14)."""
    bits = q.to(tl.int32, bitcast=True)
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # 0xFFF00000: sign, exponent, 3 bits
    normal = (bits & 0x7F800000) >= (121 << 23)
    return tl.where(normal, kept.to(tl.float32, bitcast=True), (q + 24576.0) - 24576.0)


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
    x2, delta, weight = rms_norm_rows(x, weight, residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if delta is None:
        delta, total = x2, out  # unused by the kernel
    else:
        total = torch.empty_like(out)
    launch_rms_norm(x2, delta, weight, out, total, eps, residual is not None)
    out = out.view(x.shape)
    return out if residual is None else (total.view(x.shape), out)


# e4m3's largest finite value: a quantized row's largest magnitude maps to it.
FP8_MAX = 448.0


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None):
    """``rms_norm``'s arguments checked and flattened: (x as (rows, dim), the residual as
    (rows, dim) or None, the weight contiguous). Raises ValueError as ``rms_norm``."""
    dim = x.shape[-1]
    if dim == 0:
        raise ValueError("rms_norm needs a last dimension of at least 1")
    if weight.shape != (dim,) or weight.dtype != x.dtype:
        raise ValueError(
            f"weight must be ({dim},) {x.dtype}, got {tuple(weight.shape)} {weight.dtype}"
        )
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError("residual must match x in shape and dtype")
    x2 = x.reshape(-1, dim)
    delta = None if residual is None else residual.reshape(-1, dim)
    if x2.stride(-1) != 1 or (delta is not None and delta.stride(-1) != 1):
        raise ValueError("the last dimension must be contiguous")
    return x2, delta, weight.contiguous()


def launch_rms_norm(
    x2, delta, weight, out, total, eps: float, add: bool, scales=None, amax=None, quant=STORE
) -> None:
    """One ``_rms_norm_kernel`` launch over (rows, dim) ``x2`` (checked by the caller):
    norm(x2 [+ delta]) into ``out``, the sum into ``total`` when ``add``. ``out`` is in x2's
    dtype (``quant`` ``STORE``) or e4m3 with float32 ``scales`` and ``amax`` as
    ``store_quantized`` takes them."""
    rows, dim = x2.shape
    block_m = rows_per_program(dim)
    if rows:
        _rms_norm_kernel[(triton.cdiv(rows, block_m),)](
            x2, delta, weight, out, total, weight if scales is None else scales,
            weight if amax is None else amax, rows, x2.stride(0), delta.stride(0),
            out.stride(0), total.stride(0), dim, eps, ADD=add, QUANT=quant, FP8_MAX=FP8_MAX,
            BLOCK_M=block_m, BLOCK=triton.next_power_of_2(dim),
            num_warps=4 if dim <= 2048 else 8,
        )  # fmt: skip


# Activation codes of ``activation`` (constexpr arguments of the kernels that apply one).
RELU, GELU_TANH, SILU = 1, 2, 3
# The gates of the gated kernels (``gated_mul_interleaved``, ``triton_gated_linear``), by
# name, and every activation's torch function (the references').
GATE_ACTIVATIONS = {"silu": SILU, "gelu_tanh": GELU_TANH}
TORCH_ACTIVATIONS = {
    "relu": F.relu,
    "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
    "silu": F.silu,
}


@triton.jit
def activation(x, ACT: tl.constexpr):
    """ReLU, tanh-approximated GELU or SiLU of float32 x (ACT: ``RELU``, ``GELU_TANH``,
    ``SILU``; anything else: x unchanged)."""
    if ACT == 1:
        x = tl.maximum(x, 0.0)
    elif ACT == 2:  # HF's gelu_new: 0.5 x (1 + tanh(sqrt(2 / pi) (x + c x^3)))
        z = 0.7978845608028654 * (x + 0.044715 * x * x * x)
        # 0.5 (1 + tanh z) = 1 / (1 + exp(-2 z)); this form keeps the negative tail (no
        # cancellation of 1 - 1 / (1 + exp(2 z)) to 0).
        x = x / (1.0 + tl.exp(-2.0 * z))
    elif ACT == 3:
        x = x / (1.0 + tl.exp(-x))
    return x


@triton.jit
def _interleaved_gated_mul_kernel(
    GU, OUT, stride_gu, stride_o, inter, ACT: tl.constexpr, BLOCK: tl.constexpr
):  # fmt: skip
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    pairs = offs[:, None] * 2 + tl.arange(0, 2)[None, :]  # (gate, up) side by side
    gu = tl.load(GU + row * stride_gu + pairs, mask=ok[:, None], other=0.0).to(tl.float32)
    g, u = gu.split()
    dtype = OUT.dtype.element_ty
    act = activation(g, ACT).to(dtype)
    tl.store(OUT + row * stride_o + offs, (act.to(tl.float32) * u).to(dtype), mask=ok)


def gated_mul_interleaved(gate_up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(gate) * up in one pass, gate and up interleaved in the columns of one projection
    (``xgr.layers.linear.interleave_gate_up``'s layout).

    Args:
        gate_up: (T, 2 I), columns gate 0, up 0, gate 1, up 1, ...; last dimension contiguous.
        act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU).

    Returns:
        (T, I) in gate_up's dtype.

    Raises:
        ValueError: not 2-D floats, an odd number of columns, a non-contiguous last
            dimension, or another activation.
    """
    if act not in GATE_ACTIVATIONS:
        raise ValueError(f"act must be one of {list(GATE_ACTIVATIONS)}, got {act!r}")
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_floating_point():
        raise ValueError(f"gate_up must be (T, 2 I) floats, got {tuple(gate_up.shape)} "
                         f"{gate_up.dtype}")  # fmt: skip
    if gate_up.stride(-1) != 1:
        raise ValueError("gate_up needs a contiguous last dimension")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(max(inter, 1)))
    if rows and inter:
        _interleaved_gated_mul_kernel[(rows, triton.cdiv(inter, block))](
            gate_up, out, gate_up.stride(0), out.stride(0), inter,
            ACT=GATE_ACTIVATIONS[act], BLOCK=block,
        )  # fmt: skip
    return out


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
    block_m = rows_per_program(head_dim)
    if rows:
        _rope_kernel[(triton.cdiv(rows, block_m),)](
            x, cos, sin, out, rows, heads, x.stride(0), x.stride(1), cos.stride(0),
            out.stride(0), out.stride(1), HALF=half, BLOCK_M=block_m, num_warps=4,
        )  # fmt: skip
    return out


@triton.jit
def _qkv_heads_kernel(
    QKV, COS, SIN, QW, KW, Q_OUT, K_OUT, V_OUT, rows, eps,
    stride_t, stride_ct, stride_kt, stride_kh, stride_vt, stride_vh,
    Q_HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
):  # fmt: skip
    # Rows are (token, head) pairs over the q heads, then the k heads, then the v heads of
    # each token: the column order of the fused projection's output.
    heads: tl.constexpr = Q_HEADS + 2 * KV_HEADS
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = r < rows
    t = (r // heads).to(tl.int64)
    h = r % heads
    is_q = h < Q_HEADS
    is_v = h >= Q_HEADS + KV_HEADS
    is_k = ~is_q & ~is_v
    offs = tl.arange(0, HALF)[None, :]
    ok2 = ok[:, None]
    x_ptr = QKV + t[:, None] * stride_t + h[:, None] * (2 * HALF) + offs
    lo = tl.load(x_ptr, mask=ok2, other=0.0).to(tl.float32)
    hi = tl.load(x_ptr + HALF, mask=ok2, other=0.0).to(tl.float32)
    dtype = Q_OUT.dtype.element_ty
    if NORM:  # per-head RMSNorm of q and k, rounded as ``rms_norm`` rounds it
        ss = tl.sum(lo * lo, 1) + tl.sum(hi * hi, 1)
        rstd = (1.0 / tl.sqrt(ss / (2 * HALF) + eps))[:, None]
        w_lo = tl.where(is_q[:, None], tl.load(QW + offs), tl.load(KW + offs))
        w_hi = tl.where(is_q[:, None], tl.load(QW + HALF + offs), tl.load(KW + HALF + offs))
        n_lo = (lo * rstd).to(dtype).to(tl.float32) * w_lo.to(tl.float32)
        n_hi = (hi * rstd).to(dtype).to(tl.float32) * w_hi.to(tl.float32)
        lo = tl.where(is_v[:, None], lo, n_lo.to(dtype).to(tl.float32))
        hi = tl.where(is_v[:, None], hi, n_hi.to(dtype).to(tl.float32))
    # RoPE of q and k as ``apply_rope`` rounds it; v passes through.
    c_ptr = COS + t[:, None] * stride_ct + offs
    s_ptr = SIN + t[:, None] * stride_ct + offs
    c_lo = tl.load(c_ptr, mask=ok2, other=0.0).to(tl.float32)
    c_hi = tl.load(c_ptr + HALF, mask=ok2, other=0.0).to(tl.float32)
    s_lo = tl.load(s_ptr, mask=ok2, other=0.0).to(tl.float32)
    s_hi = tl.load(s_ptr + HALF, mask=ok2, other=0.0).to(tl.float32)
    r_lo = (lo * c_lo).to(dtype).to(tl.float32) + (-hi * s_lo).to(dtype).to(tl.float32)
    r_hi = (hi * c_hi).to(dtype).to(tl.float32) + (lo * s_hi).to(dtype).to(tl.float32)
    out_lo = tl.where(is_v[:, None], lo, r_lo).to(dtype)
    out_hi = tl.where(is_v[:, None], hi, r_hi).to(dtype)
    q_ptr = Q_OUT + t[:, None] * (Q_HEADS * 2 * HALF) + h[:, None] * (2 * HALF) + offs
    q_ok = ok2 & is_q[:, None]
    tl.store(q_ptr, out_lo, mask=q_ok)
    tl.store(q_ptr + HALF, out_hi, mask=q_ok)
    k_ptr = K_OUT + t[:, None] * stride_kt + (h - Q_HEADS)[:, None] * stride_kh + offs
    k_ok = ok2 & is_k[:, None]
    tl.store(k_ptr, out_lo, mask=k_ok)
    tl.store(k_ptr + HALF, out_hi, mask=k_ok)
    v_ptr = V_OUT + t[:, None] * stride_vt + (h - Q_HEADS - KV_HEADS)[:, None] * stride_vh + offs
    v_ok = ok2 & is_v[:, None]
    tl.store(v_ptr, out_lo, mask=v_ok)
    tl.store(v_ptr + HALF, out_hi, mask=v_ok)


def qkv_heads(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_out: torch.Tensor,
    v_out: torch.Tensor,
    q_norm_weight: torch.Tensor | None = None,
    k_norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """The fused q/k/v projection's output made ready for attention, in one pass.

    Per (token, head): optional per-head RMSNorm of q and k (Qwen3), RoPE of q and k, and
    the k and v heads written straight into their KV cache slots. Replaces two norms, two
    RoPE passes and the K/V copies (with the copies that strided column views cost them):
    six to eight kernels per layer. Rounds as ``rms_norm`` then ``apply_rope`` do.

    Args:
        qkv: (T, (num_heads + 2 * num_kv_heads) * head_dim), the q, k, v columns in order;
            rows may be strided, the last dimension contiguous.
        num_heads, num_kv_heads: query and KV heads.
        cos, sin: (T, head_dim) tables of ``rope_cos_sin``, with equal strides.
        k_out, v_out: (T, num_kv_heads, head_dim) destinations (e.g. a KV cache slot), any
            token and head strides, contiguous last dimension; written in place.
        q_norm_weight, k_norm_weight: (head_dim,) RMSNorm scales, both or neither.
        eps: the norms' epsilon.

    Returns:
        q: (T, num_heads, head_dim) contiguous, in qkv's dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit, or a head_dim that is not a
            power of two.
    """
    tokens = qkv.shape[0]
    heads = num_heads + 2 * num_kv_heads
    head_dim = qkv.shape[1] // heads if qkv.dim() == 2 else 0
    half = head_dim // 2
    kv_shape = (tokens, num_kv_heads, head_dim)
    if qkv.dim() != 2 or qkv.shape[1] != heads * head_dim or half < 1 or half & (half - 1):
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {heads} power-of-two heads")
    if qkv.stride(-1) != 1 or cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"qkv and the tables {tuple(cos.shape)}, {tuple(sin.shape)} do not fit")
    if sin.stride() != cos.stride() or sin.dtype != cos.dtype:
        raise ValueError("cos and sin need the same strides and dtype")
    if cos.stride(-1) != 1:
        raise ValueError("the tables need a contiguous last dimension")
    for name, t in (("k_out", k_out), ("v_out", v_out)):
        if t.shape != kv_shape or t.dtype != qkv.dtype or t.stride(-1) != 1:
            raise ValueError(f"{name} must be {kv_shape} {qkv.dtype}, got {tuple(t.shape)}")
    norm = q_norm_weight is not None
    if norm != (k_norm_weight is not None):
        raise ValueError("give both q and k norm weights, or neither")
    if norm:
        for w in (q_norm_weight, k_norm_weight):
            if w.shape != (head_dim,) or w.dtype != qkv.dtype:
                raise ValueError(f"norm weights must be ({head_dim},) {qkv.dtype}")
        q_norm_weight, k_norm_weight = q_norm_weight.contiguous(), k_norm_weight.contiguous()
    else:
        q_norm_weight = k_norm_weight = cos  # unread
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    rows = tokens * heads
    block_m = rows_per_program(head_dim, QKV_TILE_ELEMENTS)
    if rows:
        _qkv_heads_kernel[(triton.cdiv(rows, block_m),)](
            qkv, cos, sin, q_norm_weight, k_norm_weight, q, k_out, v_out, rows, eps,
            qkv.stride(0), cos.stride(0), k_out.stride(0), k_out.stride(1), v_out.stride(0),
            v_out.stride(1), Q_HEADS=num_heads, KV_HEADS=num_kv_heads, HALF=half, NORM=norm,
            BLOCK_M=block_m, num_warps=4,
        )  # fmt: skip
    return q
