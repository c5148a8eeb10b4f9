"""Triton causal attention over a batch of packed prompts of different lengths (prefill).

One program computes one block of BLOCK_M query rows of one head of one prompt, with the
online softmax of FlashAttention (Dao et al., 2022; Milakov & Gimelshein, 2018): the key
tiles wholly before the block's first row need no mask, and only the tiles on the diagonal
apply the causal mask. Prompts are found through device offsets, so one launch (and one
CUDA graph) serves any set of lengths up to ``max_seqlen``; blocks past a prompt's end
return at once. Query blocks are launched longest first (the last blocks of a prompt attend
to the most keys), so the short ones fill the tail of the grid. Each tile's update is the
decode kernel's (``triton_decode_attention.attend_prompt_tile``, in its causal mode on the
diagonal).

The reference is ``xgr.kernels.prefill_attention.prefill_attention_reference`` (PyTorch SDPA
per prompt); ``prefill_attention`` chooses this kernel for several prompts (the measurements
are in its module's docstring).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgr.kernels.triton_decode_attention import LOG2E, attend_prompt_tile

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128, 256)


@triton.jit
def _prefill_attention_kernel(
    Q, K, V, CU, OUT,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ot, stride_oh,
    num_m_blocks, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, FOR_LOOP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid: (query blocks of the longest prompt, query heads, prompts)."""
    m_block = num_m_blocks - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    start = tl.load(CU + seq).to(tl.int64)
    length = (tl.load(CU + seq + 1) - start).to(tl.int32)
    q_lo = m_block * BLOCK_M
    if q_lo < length:
        rows = q_lo + tl.arange(0, BLOCK_M)
        d = tl.arange(0, HEAD_DIM)
        row_ok = (rows < length)[:, None]
        q_ptr = Q + (start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
        q = tl.load(q_ptr, mask=row_ok, other=0.0)
        kv_head = head // GROUP
        K_seq = K + start * stride_kt
        V_seq = V + start * stride_kt
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        diagonal_end = tl.minimum(q_lo + BLOCK_M, length)
        if FOR_LOOP:  # compiled: for loops are software-pipelined
            for kv in range(0, q_lo, BLOCK_N):
                m_i, l_i, acc = attend_prompt_tile(
                    q, K_seq, V_seq, kv, length, kv_head, stride_kt, stride_kh, d,
                    m_i, l_i, acc, scale_log2, BLOCK_N, PRECISION, False, rows, False, False, 0,
                )  # fmt: skip
            for kv in range(q_lo, diagonal_end, BLOCK_N):
                m_i, l_i, acc = attend_prompt_tile(
                    q, K_seq, V_seq, kv, length, kv_head, stride_kt, stride_kh, d,
                    m_i, l_i, acc, scale_log2, BLOCK_N, PRECISION, True, rows, True, False, 0,
                )  # fmt: skip
        else:  # Triton's interpreter takes no tensor bounds in range()
            kv = 0
            while kv < q_lo:
                m_i, l_i, acc = attend_prompt_tile(
                    q, K_seq, V_seq, kv, length, kv_head, stride_kt, stride_kh, d,
                    m_i, l_i, acc, scale_log2, BLOCK_N, PRECISION, False, rows, False, False, 0,
                )  # fmt: skip
                kv += BLOCK_N
            while kv < diagonal_end:
                m_i, l_i, acc = attend_prompt_tile(
                    q, K_seq, V_seq, kv, length, kv_head, stride_kt, stride_kh, d,
                    m_i, l_i, acc, scale_log2, BLOCK_N, PRECISION, True, rows, True, False, 0,
                )  # fmt: skip
                kv += BLOCK_N
        # Every row saw key q_lo at least (l_i > 0); rows past the prompt's end are not stored.
        out = acc / l_i[:, None]
        o_ptr = OUT + (start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok)


def packed_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
    block_m: int = 128,
    block_n: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
) -> torch.Tensor:
    """Causal self-attention within each prompt of a packed batch, one launch.

    Args:
        q: (total_tokens, num_heads, head_dim) fp16/bf16/fp32, last dimension contiguous.
        k, v: (total_tokens, num_kv_heads, head_dim) with equal strides; num_heads is a
            multiple of num_kv_heads (GQA).
        cu_seqlens: (R + 1,) int32/int64 token offsets of each prompt, on q's device.
        max_seqlen: a bound on the longest prompt (tokens); prompts longer than it are
            computed only up to it (so it must not be smaller than the longest).
        scale: softmax scale.
        block_m, block_n: query rows and keys per tile (block_m a multiple of block_n).
        num_warps, num_stages: launch parameters.

    Returns:
        (total_tokens, num_heads, head_dim) in q's dtype; tokens after the last prompt's end
        (cu_seqlens[-1]) are left unwritten. Accumulation is float32.

    Raises:
        ValueError: shapes, strides, dtypes or tile sizes that do not fit.
    """
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape[0] != tokens or k.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"k {tuple(k.shape)} does not fit q {tuple(q.shape)}")
    if head_dim not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not one of {SUPPORTED_HEAD_DIMS}")
    if k.stride() != v.stride() or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("k and v need equal strides, and q, k, v a contiguous last dimension")
    if q.dtype != k.dtype or v.dtype != k.dtype:
        raise ValueError(f"dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.device != q.device:
        raise ValueError("cu_seqlens must be a 1-D tensor on q's device")
    if block_m % block_n:
        raise ValueError(f"block_m {block_m} must be a multiple of block_n {block_n}")
    out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_prompts = cu_seqlens.numel() - 1
    num_m_blocks = triton.cdiv(max(max_seqlen, 1), block_m)
    if num_prompts < 1 or tokens == 0:
        return out
    _prefill_attention_kernel[(num_m_blocks, num_heads, num_prompts)](
        q, k, v, cu_seqlens, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
        num_m_blocks, scale * LOG2E,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n,
        FOR_LOOP=q.is_cuda,
        # float32 stays float32 on tensor cores (no tf32): the reference path's exactness.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
