"""Triton kernel of ``beam_self_attention_reference``: one launch per decoder layer and step.

The torch reference takes about a dozen kernels (the K/V writes, the ancestry gathers,
float32 casts, two batched products, the softmax); with 12 decoder layers and 3 levels
they were a third of a OneRec-size decode's kernels. Here
one program per query row holds all heads of the row: it writes the new K/V, scores the
newest token from registers, then folds the earlier slots (at most a few) in by online
softmax (Milakov & Gimelshein, 2018), reading each through the ancestry index.

``start_and_codes_attention`` is the same for the pass that runs each request's start
token and its candidate first codes together (``start_and_codes_attention_reference``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _beam_self_attention_kernel(
    Q, KN, VN, BK, BV, ROWS, KV_ROWS, BIAS, OUT,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_br, stride_bs, stride_bh, stride_rr, stride_bias_h, stride_on, stride_oh,
    SLOT: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):  # fmt: skip
    # SLOT is a compile-time constant: a handful of values (one per level), each loop unrolled.
    n = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    ok = h_ok[:, None] & (d < D)[None, :]
    q = tl.load(Q + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=ok, other=0.0)
    k_new = tl.load(KN + n * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
    v_new = tl.load(VN + n * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
    row = tl.load(KV_ROWS + n).to(tl.int64)
    head_off = h[:, None] * stride_bh + d[None, :]
    new_off = row * stride_br + SLOT * stride_bs + head_off
    tl.store(BK + new_off, k_new, mask=ok)
    tl.store(BV + new_off, v_new, mask=ok)
    q = q.to(tl.float32)
    # The newest slot, from registers (its K/V were just stored, by this program only).
    m_i = tl.sum(q * k_new.to(tl.float32), axis=1)
    m_i += tl.load(BIAS + h * stride_bias_h + SLOT, mask=h_ok, other=0.0).to(tl.float32)
    l_i = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = v_new.to(tl.float32)
    for s in tl.static_range(SLOT):
        src = tl.load(ROWS + row * stride_rr + s).to(tl.int64)
        off = src * stride_br + s * stride_bs + head_off
        k = tl.load(BK + off, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(BV + off, mask=ok, other=0.0).to(tl.float32)
        score = tl.sum(q * k, axis=1)
        score += tl.load(BIAS + h * stride_bias_h + s, mask=h_ok, other=0.0).to(tl.float32)
        m_new = tl.maximum(m_i, score)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(score - m_new)
        l_i = l_i * alpha + p
        acc = acc * alpha[:, None] + p[:, None] * v
        m_i = m_new
    out = acc / l_i[:, None]
    out_off = n * stride_on + h[:, None] * stride_oh + d[None, :]
    tl.store(OUT + out_off, out.to(OUT.dtype.element_ty), mask=ok)


def _check_rows_and_beam(q, k_named, v_named, beam_k, beam_v) -> None:
    """The launchers' shared checks: (name, tensor) k and v shaped as q, beam K and V of
    one shape and layout. Raises ValueError naming the tensors."""
    (k_name, k), (v_name, v) = k_named, v_named
    if k.shape != q.shape or v.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, {k_name} {tuple(k.shape)}, {v_name} "
                         f"{tuple(v.shape)} must match")  # fmt: skip
    if beam_k.shape != beam_v.shape or beam_k.stride() != beam_v.stride():
        raise ValueError("beam_k and beam_v must share one shape and layout")


def beam_self_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
    beam_rows: torch.Tensor,
    kv_rows: torch.Tensor,
    slot: int,
    bias: torch.Tensor,
) -> torch.Tensor:
    """``beam_self_attention_reference`` in one launch; same arguments, shapes and result.

    q, k_new and v_new may be strided views (e.g. of one fused q/k/v GEMM) whose last
    dimension is contiguous; beam_k and beam_v share one layout.

    Raises:
        ValueError: mismatched shapes, a non-contiguous last dimension, or slot outside
            [0, capacity).
    """
    rows, num_heads, head_dim = q.shape
    capacity = beam_k.shape[1]
    _check_rows_and_beam(q, ("k_new", k_new), ("v_new", v_new), beam_k, beam_v)
    if beam_k.shape[2:] != (num_heads, head_dim) or not 0 <= slot < capacity:
        raise ValueError(f"beam K/V {tuple(beam_k.shape)} do not hold slot {slot} of "
                         f"{num_heads} heads x {head_dim}")  # fmt: skip
    if bias.shape != (num_heads, slot + 1) or kv_rows.shape != (rows,):
        raise ValueError(f"bias {tuple(bias.shape)} / kv_rows {tuple(kv_rows.shape)} do not "
                         f"fit {rows} rows, {num_heads} heads, slot {slot}")  # fmt: skip
    tensors = (q, k_new, v_new, beam_k, beam_v, beam_rows, bias)
    if any(t.stride(-1) != 1 and t.shape[-1] > 1 for t in tensors):
        raise ValueError("every tensor's last dimension must be contiguous")
    kv_rows = kv_rows.contiguous()  # the kernel reads it with unit stride
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _beam_self_attention_kernel[(rows,)](
        q, k_new, v_new, beam_k, beam_v, beam_rows, kv_rows, bias, out,
        q.stride(0), q.stride(1), k_new.stride(0), k_new.stride(1),
        v_new.stride(0), v_new.stride(1),
        beam_k.stride(0), beam_k.stride(1), beam_k.stride(2), beam_rows.stride(0),
        bias.stride(0), out.stride(0), out.stride(1),
        SLOT=slot, H=num_heads, D=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _start_and_codes_attention_kernel(
    Q, K, V, BK, BV, BIAS, OUT,
    stride_qn, stride_qh, stride_kn, stride_kh, stride_vn, stride_vh,
    stride_br, stride_bs, stride_bh, stride_bias_h, stride_on, stride_oh,
    P, H: tl.constexpr, D: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)
    j = n % P
    start = n - j
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_ok = h < H
    ok = h_ok[:, None] & (d < D)[None, :]
    k = tl.load(K + n * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
    v = tl.load(V + n * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
    slot = tl.where(j == 0, 0, 1)
    new_off = n * stride_br + slot * stride_bs + h[:, None] * stride_bh + d[None, :]
    tl.store(BK + new_off, k, mask=ok)
    tl.store(BV + new_off, v, mask=ok)
    # The start token's K/V come from the inputs, not from the cache another program of
    # this launch writes.
    k0 = tl.load(K + start * stride_kn + h[:, None] * stride_kh + d[None, :], mask=ok, other=0.0)
    v0 = tl.load(V + start * stride_vn + h[:, None] * stride_vh + d[None, :], mask=ok, other=0.0)
    q = tl.load(Q + n * stride_qn + h[:, None] * stride_qh + d[None, :], mask=ok, other=0.0)
    q = q.to(tl.float32)
    s0 = tl.sum(q * k0.to(tl.float32), axis=1)
    s0 += tl.load(BIAS + h * stride_bias_h, mask=h_ok, other=0.0).to(tl.float32)
    s1 = tl.sum(q * k.to(tl.float32), axis=1)
    s1 += tl.load(BIAS + h * stride_bias_h + 1, mask=h_ok, other=0.0).to(tl.float32)
    m = tl.maximum(s0, s1)
    p0 = tl.exp(s0 - m)
    p1 = tl.exp(s1 - m)
    out = (p0[:, None] * v0.to(tl.float32) + p1[:, None] * v.to(tl.float32)) / (p0 + p1)[:, None]
    out = tl.where(j == 0, v.to(tl.float32), out)
    out_off = n * stride_on + h[:, None] * stride_oh + d[None, :]
    tl.store(OUT + out_off, out.to(OUT.dtype.element_ty), mask=ok)


def start_and_codes_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
    rows_per_request: int,
    bias: torch.Tensor,
) -> torch.Tensor:
    """``start_and_codes_attention_reference`` in one launch (one program a row); same
    arguments, shapes and result. q, k and v may be strided views whose last dimension is
    contiguous; beam_k and beam_v share one layout.

    Raises:
        ValueError: mismatched q/k/v shapes, N not a multiple of ``rows_per_request``, beam
            K and V of different shapes or layouts, beam K/V with fewer than N rows or 2
            slots or other heads, a bias not (num_heads, 2), or a non-contiguous last
            dimension.
    """
    rows, num_heads, head_dim = q.shape
    _check_rows_and_beam(q, ("k", k), ("v", v), beam_k, beam_v)
    if rows_per_request < 1 or rows % rows_per_request:
        raise ValueError(f"{rows} rows are not requests of {rows_per_request} rows each")
    if beam_k.shape[0] < rows or beam_k.shape[1] < 2 or beam_k.shape[2:] != (num_heads, head_dim):
        raise ValueError(f"beam K/V {tuple(beam_k.shape)} do not hold slots 0-1 of {rows} "
                         f"rows of {num_heads} heads x {head_dim}")  # fmt: skip
    if bias.shape != (num_heads, 2):
        raise ValueError(f"bias {tuple(bias.shape)} must be ({num_heads}, 2)")
    if any(t.stride(-1) != 1 for t in (q, k, v, beam_k, beam_v, bias)):
        raise ValueError("every tensor's last dimension must be contiguous")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _start_and_codes_attention_kernel[(rows,)](
        q, k, v, beam_k, beam_v, bias, out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        beam_k.stride(0), beam_k.stride(1), beam_k.stride(2), bias.stride(0),
        out.stride(0), out.stride(1),
        rows_per_request, H=num_heads, D=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )  # fmt: skip
    return out
