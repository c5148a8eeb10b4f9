"""Triton encoder self-attention with T5's relative position bias, over padded prompts.

One program computes BLOCK_M query rows of one head of one prompt with the online softmax
of FlashAttention (Dao et al., 2022), each tile's update being the decode kernel's
(``triton_decode_attention.attend_prompt_tile`` in its bias mode): the bias of each score
is read from the head's 2P - 1 per-offset values instead of a (heads, P, P) mask, and keys
past the prompt's length (read from the device) are masked; key tiles beyond T5's
max_distance from every row of the block add that distance's one bias instead. The torch
reference is ``xgr.kernels.encoder_attention.padded_biased_attention_reference`` (SDPA with
the square mask). The engine's encoder graph runs this kernel
(``xgr.models.t5.ENCODER_ATTENTION``): once the far tiles take one bias it beats SDPA with
the mask at the OneRec-like shape, and builds no mask (``benchmarks/attention.py --encoder``;
docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgr.kernels.triton_decode_attention import LOG2E, attend_prompt_tile, attend_tiles

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)


@triton.jit
def _padded_biased_attention_kernel(
    Q, K, V, LENGTHS, BIAS, OUT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh, stride_bh,
    padded_len, far, scale_log2,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    FOR_LOOP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid: (query blocks of P, heads, prompts)."""
    head = tl.program_id(1)
    slot = tl.program_id(2)
    start = slot.to(tl.int64) * padded_len
    length = tl.load(LENGTHS + slot).to(tl.int32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < padded_len
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + (start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    # Rows past P (a partial last block) take row P - 1's bias: read in bounds, never stored.
    bias_rows = tl.minimum(rows, padded_len - 1)
    bias = BIAS + head * stride_bh + padded_len - 1  # offset 0
    K_seq = K + start * stride_kt
    V_seq = V + start * stride_kt
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full = length // BLOCK_N * BLOCK_N
    # Full key tiles whose every offset from this block's rows is <= -far (before
    # near_start) or >= far (from far_start) take the table's one value there, a scalar;
    # only the tiles between gather a value per score. far >= P: every tile gathers.
    i0 = tl.program_id(0) * BLOCK_M
    near_start = tl.minimum(tl.maximum((i0 - far + 1) // BLOCK_N * BLOCK_N, 0), full)
    far_start = tl.cdiv(i0 + BLOCK_M - 1 + far, BLOCK_N) * BLOCK_N
    far_start = tl.maximum(tl.minimum(far_start, full), near_start)
    in_table = tl.minimum(far, padded_len - 1)
    before = tl.load(bias - in_table).to(tl.float32)
    after = tl.load(bias + in_table).to(tl.float32)
    m_i, l_i, acc = attend_tiles(
        q, K_seq, V_seq, 0, near_start, length, head, stride_kt, stride_kh, d, m_i, l_i, acc,
        scale_log2, bias_rows, before, BLOCK_N, PRECISION, 2, FOR_LOOP,
    )  # fmt: skip
    m_i, l_i, acc = attend_tiles(
        q, K_seq, V_seq, near_start, far_start, length, head, stride_kt, stride_kh, d, m_i,
        l_i, acc, scale_log2, bias_rows, bias, BLOCK_N, PRECISION, True, FOR_LOOP,
    )  # fmt: skip
    m_i, l_i, acc = attend_tiles(
        q, K_seq, V_seq, far_start, full, length, head, stride_kt, stride_kh, d, m_i, l_i,
        acc, scale_log2, bias_rows, after, BLOCK_N, PRECISION, 2, FOR_LOOP,
    )  # fmt: skip
    if full < length:
        m_i, l_i, acc = attend_prompt_tile(
            q, K_seq, V_seq, full, length, head, stride_kt, stride_kh, d, m_i, l_i, acc,
            scale_log2, BLOCK_N, PRECISION, True, bias_rows, False, True, bias,
        )  # fmt: skip
    out = acc / l_i[:, None]
    o_ptr = OUT + (start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def runs_on(device: torch.device) -> bool:
    """Whether ``padded_biased_attention`` can take tensors on ``device``: CUDA when the
    kernel is compiled; any device under Triton's interpreter. Read off the kernel itself,
    since Triton decides interpreting once, when this module is imported."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted = isinstance(_padded_biased_attention_kernel, InterpretedFunction)
    return interpreted or device.type == "cuda"


def padded_biased_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    bias_by_offset: torch.Tensor,
    padded_len: int,
    *,
    constant_beyond: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """``padded_biased_attention_reference`` in one Triton launch (softmax scale 1, as T5).

    T5's buckets give every offset at least ``max_distance`` away one bias per direction
    (``xgr.layers.relative_position.relative_position_bucket``). Given that distance as
    ``constant_beyond``, key tiles entirely that far from a query block add one scalar
    instead of reading a bias per score: for a 1024-token OneRec-like prompt (max_distance
    128) most tiles, which is what makes this kernel faster than gathering every score's
    bias and than SDPA with the square mask (docs/performance.md).

    Args:
        q, k, v: (S * P, num_heads, head_dim) fp16/bf16/fp32, one dtype, last dimension
            contiguous, k and v with equal strides (views of a fused q/k/v projection are
            fine).
        lengths: (S,) int32/int64 prompt lengths on q's device, each in [1, P] (unchecked:
            a device read would synchronize).
        bias_by_offset: (num_heads, 2 * P - 1) on q's device, last dimension contiguous.
        padded_len: P.
        constant_beyond: a distance D >= 1 such that ``bias_by_offset`` holds one value
            for all offsets >= D and one for all offsets <= -D (T5: the config's
            ``relative_attention_max_distance``), or None: no such distance (every score
            reads its own). A wrong D gives wrong results: it is not checked (that would read
            the table on the host).
        block_m, block_n, num_warps, num_stages: launch parameters.

    Returns:
        (S * P, num_heads, head_dim) in q's dtype; accumulation is float32.

    Raises:
        ValueError: shapes, strides or head sizes that do not fit.
    """
    if q.dim() != 3 or k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} differ")
    rows, heads, head_dim = q.shape
    if padded_len < 1 or rows % padded_len:
        raise ValueError(f"{rows} rows are not prompts padded to {padded_len}")
    slots = rows // padded_len
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.stride() != v.stride() or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous last dimension and k, v equal strides")
    if lengths.shape != (slots,) or lengths.device != q.device:
        raise ValueError(f"lengths must be ({slots},) on {q.device}, got {tuple(lengths.shape)}")
    # (H, 1) for P = 1 may carry any last stride: it is never stepped along.
    contiguous = bias_by_offset.dim() == 2 and (
        bias_by_offset.shape[-1] == 1 or bias_by_offset.stride(-1) == 1
    )
    if bias_by_offset.shape != (heads, 2 * padded_len - 1) or not contiguous:
        raise ValueError(
            f"bias_by_offset must be ({heads}, {2 * padded_len - 1}) with a contiguous last "
            f"dimension, got {tuple(bias_by_offset.shape)} strides {bias_by_offset.stride()}"
        )
    if bias_by_offset.device != q.device:
        raise ValueError(f"bias_by_offset must be on {q.device}, got {bias_by_offset.device}")
    if constant_beyond is not None and constant_beyond < 1:
        raise ValueError(f"constant_beyond must be at least 1, got {constant_beyond}")
    # At P or beyond no key tile is that far from any query: every score reads its bias.
    far = padded_len if constant_beyond is None else min(constant_beyond, padded_len)
    out = torch.empty(rows, heads, head_dim, dtype=q.dtype, device=q.device)
    if rows == 0:
        return out
    grid = (triton.cdiv(padded_len, block_m), heads, slots)
    _padded_biased_attention_kernel[grid](
        q, k, v, lengths, bias_by_offset, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        # Scale 1: the bias is added to the scores before the kernel's exp2 scaling, which
        # is then exactly the natural-log softmax of score + bias.
        bias_by_offset.stride(0), padded_len, far, LOG2E,
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, FOR_LOOP=q.is_cuda,
        # float32 stays float32 on tensor cores (no tf32), as the other kernels.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out


@triton.jit
def _square_mask_kernel(
    BIAS, LENGTHS, OUT, stride_bh, heads, padded_len,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Grid: (query blocks x key blocks, heads, prompts)."""
    key_blocks = tl.cdiv(padded_len, BLOCK_K)
    q = tl.program_id(0) // key_blocks * BLOCK_Q + tl.arange(0, BLOCK_Q)
    k = tl.program_id(0) % key_blocks * BLOCK_K + tl.arange(0, BLOCK_K)
    head, slot = tl.program_id(1), tl.program_id(2)
    ok = (q < padded_len)[:, None] & (k < padded_len)[None, :]
    offset = k[None, :] - q[:, None] + padded_len - 1
    bias = tl.load(BIAS + head * stride_bh + offset, mask=ok, other=0.0).to(tl.float32)
    length = tl.load(LENGTHS + slot)
    bias = tl.where((k < length)[None, :], bias, float("-inf"))
    plane = (slot.to(tl.int64) * heads + head) * padded_len
    out = OUT + (plane + q[:, None]) * padded_len + k[None, :]
    tl.store(out, bias.to(OUT.dtype.element_ty), mask=ok)


def square_mask(
    lengths: torch.Tensor, bias_by_offset: torch.Tensor, padded_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """``xgr.kernels.encoder_attention.square_mask`` in one Triton pass: each element written
    once from the per-offset bias, where torch lays the square out by a flip (a copy) and
    adds the padding mask (a second pass): two passes over 32 MB of mask for one 1024-token
    OneRec-like prompt (16 heads).

    Args:
        lengths: (S,) int prompt lengths on the bias's device, each in [1, P] (unchecked: a
            device read would synchronize).
        bias_by_offset: (num_heads, 2 * P - 1), last dimension contiguous.
        padded_len: P. dtype: the mask's dtype.

    Returns:
        (S, num_heads, P, P) in ``dtype``: the bias, -inf at each prompt's padding keys.

    Raises:
        ValueError: a misshapen bias or lengths.
    """
    heads = bias_by_offset.shape[0]
    if bias_by_offset.shape != (heads, 2 * padded_len - 1) or (
        padded_len > 1 and bias_by_offset.stride(-1) != 1
    ):
        raise ValueError(f"bias_by_offset must be (heads, {2 * padded_len - 1}) with a contiguous "
                         f"last dimension, got {tuple(bias_by_offset.shape)}")  # fmt: skip
    if lengths.dim() != 1 or lengths.device != bias_by_offset.device:
        raise ValueError(f"lengths must be (S,) on {bias_by_offset.device}")
    slots = lengths.shape[0]
    out = torch.empty(slots, heads, padded_len, padded_len, dtype=dtype, device=lengths.device)
    if out.numel():
        block = min(64, triton.next_power_of_2(padded_len))
        blocks = triton.cdiv(padded_len, block)
        _square_mask_kernel[(blocks * blocks, heads, slots)](
            bias_by_offset, lengths, out, bias_by_offset.stride(0), heads, padded_len,
            BLOCK_Q=block, BLOCK_K=block,
        )  # fmt: skip
    return out
