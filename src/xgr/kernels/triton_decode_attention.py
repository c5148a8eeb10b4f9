"""Triton decode attention over a request's shared prompt KV plus each beam's own KV.

One program handles one block of (beam, query head) rows of one request and one KV head:
all beams of the request and all query heads sharing that KV head form the rows of a
matrix, so each loaded prompt-KV tile serves every beam through one tensor-core product
(the prompt KV is read once per request per step, not once per beam). The beams' own tokens
(at most a few) are then folded into the same online softmax (Milakov & Gimelshein, 2018),
which makes the merge of the two stages exact.

Two launch modes, both tested against ``decode_attention_reference``:

- fused: one launch does the shared part and the beam part;
- staged: a first launch writes the shared part's output and log-sum-exp (float32), a
  second resumes the online softmax from them for the beam part.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from xgr.kernels.decode_attention_launch import (
    CROSS_ATTENTION_LAUNCH,
    DEFAULT_LAUNCH,
    SUPPORTED_HEAD_DIMS,
    LaunchConfig,
    choose_num_splits,
)

LOG2E = 1.4426950408889634


@triton.jit
def attend_prompt_tile(
    q,
    K,
    V,
    kv,
    end,
    kv_head,
    stride_kt,
    stride_kh,
    d,
    m_i,
    l_i,
    acc,
    scale_log2,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
    MASK: tl.constexpr,
    rows,
    CAUSAL: tl.constexpr,
    BIAS: tl.constexpr,
    bias,
):
    """One online-softmax update of all rows with prompt tokens kv .. kv + BLOCK_N.

    MASK: the tile may run past ``end`` (only a split's last tile); full tiles skip the
    bounds checks, which otherwise cost a select per score in the inner loop.
    CAUSAL (with MASK): also mask each key after its query row, ``rows`` being the rows'
    token positions (the diagonal tiles of ``triton_prefill_attention``).
    BIAS: add ``bias[key - row]`` to each score (T5's relative position bias by offset,
    ``triton_encoder_attention``; ``bias`` points at offset 0, rows and keys below ``end``
    read within it); BIAS == 2: add the scalar ``bias`` to every score of the tile (offsets
    where T5's bias is constant). ``rows`` is read only under CAUSAL or BIAS == 1, ``bias``
    only under BIAS.
    """
    offs = kv + tl.arange(0, BLOCK_N)
    kv_off = offs[:, None] * stride_kt + kv_head * stride_kh + d[None, :]
    if MASK:
        ok = offs < end
        k = tl.load(K + kv_off, mask=ok[:, None], other=0.0)
    else:
        k = tl.load(K + kv_off)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    if BIAS == 2:  # one value for the whole tile: ``bias`` is that float32 scalar
        s += bias
    elif BIAS:
        # Keys past the end (masked below) read the last key's bias: within the table.
        cols = tl.minimum(offs, end - 1) if MASK else offs
        s += tl.load(bias + cols[None, :] - rows[:, None]).to(tl.float32)
    if CAUSAL:
        s = tl.where((offs[None, :] <= rows[:, None]) & ok[None, :], s, float("-inf"))
    elif MASK:
        s = tl.where(ok[None, :], s, float("-inf"))
    # Scale after the row max so exp2's argument is one fused multiply-add per score.
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASK:
        v = tl.load(V + kv_off, mask=ok[:, None], other=0.0)
    else:
        v = tl.load(V + kv_off)
    # The product accumulates into acc (no second accumulator and add per tile).
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def attend_tiles(
    q, K_seq, V_seq, lo, hi, length, head, stride_kt, stride_kh, d, m_i, l_i, acc,
    scale_log2, bias_rows, bias, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    BIAS: tl.constexpr, FOR_LOOP: tl.constexpr,
):  # fmt: skip
    """The full key tiles lo, lo + BLOCK_N, ... below hi, each by ``attend_prompt_tile``
    in bias mode BIAS (0: none; else ``bias`` the table or the tiles' one value)."""
    if FOR_LOOP:  # compiled: a for loop is software-pipelined
        for kv in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = attend_prompt_tile(
                q, K_seq, V_seq, kv, length, head, stride_kt, stride_kh, d, m_i, l_i, acc,
                scale_log2, BLOCK_N, PRECISION, False, bias_rows, False, BIAS, bias,
            )  # fmt: skip
    else:  # Triton's interpreter cannot take loaded values as range() bounds
        kv = lo
        while kv < hi:
            m_i, l_i, acc = attend_prompt_tile(
                q, K_seq, V_seq, kv, length, head, stride_kt, stride_kh, d, m_i, l_i, acc,
                scale_log2, BLOCK_N, PRECISION, False, bias_rows, False, BIAS, bias,
            )  # fmt: skip
            kv += BLOCK_N
    return m_i, l_i, acc


@triton.jit
def _beam_decode_attention_kernel(
    Q, K, V, BK, BV, ROWS, CU, OUT, PART, LSE,
    stride_qn, stride_qh,
    stride_kt, stride_kh,
    stride_bn, stride_bt, stride_bh,
    stride_rn,
    stride_on, stride_oh,
    num_rows, beam_width, scale_log2,
    NUM_BEAM_TOKENS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
    SHARED: tl.constexpr, BEAM: tl.constexpr, OUT_PARTIAL: tl.constexpr,
    FOR_LOOP: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """Grid: (row blocks, KV heads, requests x SPLITS) for the shared stage, else requests.

    SHARED: attend to split ``pid % SPLITS`` of the request's prompt; otherwise start from
    the SPLITS partial results in PART / LSE. BEAM: then attend to the beam's own tokens.
    OUT_PARTIAL: write float32 output and log-sum-exp of this split to PART / LSE (laid out
    (SPLITS, rows, heads, HEAD_DIM) and (SPLITS, rows, heads)); otherwise the final output.
    """
    pid_m = tl.program_id(0)
    kv_head = tl.program_id(1)
    if SHARED:
        req = tl.program_id(2) // SPLITS
        split = tl.program_id(2) % SPLITS
    else:
        req = tl.program_id(2)
        split = 0
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < beam_width * GROUP
    n = req * beam_width + rows // GROUP  # beam row in the batch
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + n[:, None] * stride_qn + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None], other=0.0,
    )  # fmt: skip
    num_heads = GROUP * tl.num_programs(1)
    out_ptrs = OUT + n[:, None] * stride_on + head[:, None] * stride_oh + d[None, :]
    lse_offs = n * num_heads + head  # within one split
    part_offs = lse_offs[:, None] * HEAD_DIM + d[None, :]
    split_lse = num_rows * num_heads  # elements per split in LSE
    if SHARED:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        start = tl.load(CU + req)
        end = tl.load(CU + req + 1)
        chunk = tl.cdiv(tl.cdiv(end - start, SPLITS), BLOCK_N) * BLOCK_N
        lo = start + split * chunk
        hi = tl.minimum(end, lo + chunk)
        full = lo + tl.maximum(hi - lo, 0) // BLOCK_N * BLOCK_N  # end of the unmasked tiles
        m_i, l_i, acc = attend_tiles(
            q, K, V, lo, full, hi, kv_head, stride_kt, stride_kh, d, m_i, l_i, acc,
            scale_log2, 0, 0, BLOCK_N, PRECISION, False, FOR_LOOP,
        )  # fmt: skip
        if full < hi:
            m_i, l_i, acc = attend_prompt_tile(
                q, K, V, full, hi, kv_head, stride_kt, stride_kh, d, m_i, l_i, acc,
                scale_log2, BLOCK_N, PRECISION, True, 0, False, False, 0,
            )  # fmt: skip
    else:
        # Merge the splits (split 0 always holds tokens: every prompt has at least one).
        acc = tl.load(PART + part_offs, mask=row_ok[:, None], other=0.0)
        m_i = tl.load(LSE + lse_offs, mask=row_ok, other=0.0) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        for s in tl.static_range(1, SPLITS):
            lse_s = tl.load(LSE + s * split_lse + lse_offs, mask=row_ok, other=0.0)
            lse_s = lse_s * 1.4426950408889634
            out_s = tl.load(
                PART + s * split_lse * HEAD_DIM + part_offs, mask=row_ok[:, None], other=0.0
            )
            m_new = tl.maximum(m_i, lse_s)
            alpha = tl.exp2(m_i - m_new)
            weight = tl.exp2(lse_s - m_new)  # 0 for an empty split (lse -inf)
            acc = acc * alpha[:, None] + weight[:, None] * out_s
            l_i = l_i * alpha + weight
            m_i = m_new
    if BEAM:
        qf = q.to(tl.float32)
        for j in tl.static_range(NUM_BEAM_TOKENS):  # a few tokens: unrolled
            src = tl.load(ROWS + n * stride_rn + j, mask=row_ok, other=0)
            b_off = src[:, None] * stride_bn + j * stride_bt + kv_head * stride_bh + d[None, :]
            ku = tl.load(BK + b_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(qf * ku, 1) * scale_log2
            m_new = tl.maximum(m_i, s)
            p = tl.exp2(s - m_new)
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + p
            vu = tl.load(BV + b_off, mask=row_ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + p[:, None] * vu
            m_i = m_new
    if OUT_PARTIAL:
        # An empty split (short prompt, many splits) writes 0 and lse -inf: it weighs nothing.
        safe_l = tl.where(l_i > 0, l_i, 1.0)  # acc is 0 where l is 0
        out = acc / safe_l[:, None]
        tl.store(PART + split * split_lse * HEAD_DIM + part_offs, out, mask=row_ok[:, None])
        lse = tl.where(l_i > 0, (m_i + tl.log2(safe_l)) * 0.6931471805599453, float("-inf"))
        tl.store(LSE + split * split_lse + lse_offs, lse, mask=row_ok)
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptrs, out.to(OUT.dtype.element_ty), mask=row_ok[:, None])


def _check(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
    beam_rows: torch.Tensor,
    beam_width: int,
) -> None:
    rows, num_heads, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS or q.stride(-1) != 1:
        raise ValueError(f"head_dim must be 16/32/64/128 and contiguous, got {q.shape}")
    if shared_k.dim() != 3 or shared_k.shape[2] != head_dim or shared_k.stride(-1) != 1:
        raise ValueError(f"shared KV must be (tokens, kv_heads, {head_dim}), got {shared_k.shape}")
    if shared_v.shape != shared_k.shape or shared_v.stride() != shared_k.stride():
        raise ValueError("shared_k and shared_v must have the same shape and strides")
    num_kv_heads = shared_k.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads}")
    if rows != (cu_seqlens.numel() - 1) * beam_width:
        raise ValueError(f"{rows} query rows for {cu_seqlens.numel() - 1} requests x {beam_width}")
    if beam_k.dim() != 4 or beam_k.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"beam KV must be (rows, capacity, kv_heads, head_dim), got {beam_k.shape}"
        )
    if beam_v.stride() != beam_k.stride() or beam_k.stride(-1) != 1:
        raise ValueError("beam_k and beam_v must have the same contiguous-last-dim strides")
    if beam_rows.dtype != torch.int32 or beam_rows.shape[0] != rows or beam_rows.stride(-1) != 1:
        raise ValueError(f"beam_rows must be ({rows}, capacity) int32, got {beam_rows.shape}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be int32 or int64")
    dtypes = {t.dtype for t in (q, shared_k, shared_v, beam_k, beam_v)}
    if len(dtypes) != 1 or q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"q and every KV tensor must share one float dtype, got {dtypes}")


def beam_decode_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
    beam_rows: torch.Tensor,
    num_beam_tokens: int,
    beam_width: int,
    scale: float,
    staged: bool = False,
    config: LaunchConfig = DEFAULT_LAUNCH,
) -> torch.Tensor:
    """Decode attention of every beam over its request's prompt KV and its own tokens.

    Args:
        q: (R * beam_width, num_heads, head_dim) fp16/bf16/fp32, one query per beam.
        shared_k, shared_v: (total_prompt_tokens, num_kv_heads, head_dim) packed prompt KV.
        cu_seqlens: (R + 1,) int32/int64 prompt offsets, on the device; every prompt >= 1 token.
        beam_k, beam_v: (rows, capacity, num_kv_heads, head_dim) beam tokens; slot j of
            beam n is read at row ``beam_rows[n, j]``.
        beam_rows: (R * beam_width, capacity) int32 row of each beam's j-th token.
        num_beam_tokens: slots to read per beam (0 <= num_beam_tokens <= capacity).
        beam_width: beams per request.
        scale: softmax scale.
        staged: always two launches (prompt part, then merge + beam part); otherwise one
            fused launch when a single split suffices.
        config: tile sizes, warps, pipeline depth and split count.

    Returns:
        (R * beam_width, num_heads, head_dim) in q's dtype; accumulation is float32.

    Raises:
        ValueError: shapes, strides or dtypes that do not fit.
    """
    _check(q, shared_k, shared_v, cu_seqlens, beam_k, beam_v, beam_rows, beam_width)
    rows, num_heads, head_dim = q.shape
    num_kv_heads = shared_k.shape[1]
    group = num_heads // num_kv_heads
    num_requests = cu_seqlens.numel() - 1
    row_blocks = triton.cdiv(beam_width * group, config.block_m)
    block_n = config.block_n or (128 if head_dim <= 64 else 64)
    splits = config.num_splits or choose_num_splits(
        row_blocks * num_kv_heads * num_requests, q.device
    )
    out = torch.empty_like(q)
    two_stage = staged or splits > 1
    if two_stage:
        partial = torch.empty(
            splits, rows, num_heads, head_dim, dtype=torch.float32, device=q.device
        )
        lse = torch.empty(splits, rows, num_heads, dtype=torch.float32, device=q.device)
    else:  # unused by a fused launch: no allocation on the hot path
        partial = lse = out

    def launch(shared: bool, beam: bool, out_partial: bool) -> None:
        programs = num_requests * splits if shared else num_requests
        block_m = config.block_m if shared else config.merge_block_m
        num_warps = config.num_warps if shared else config.merge_num_warps
        blocks = row_blocks if shared else triton.cdiv(beam_width * group, block_m)
        _beam_decode_attention_kernel[(blocks, num_kv_heads, programs)](
            q, shared_k, shared_v, beam_k, beam_v, beam_rows, cu_seqlens, out, partial, lse,
            q.stride(0), q.stride(1),
            shared_k.stride(0), shared_k.stride(1),
            beam_k.stride(0), beam_k.stride(1), beam_k.stride(2),
            beam_rows.stride(0),
            out.stride(0), out.stride(1),
            rows, beam_width, scale * LOG2E,
            NUM_BEAM_TOKENS=num_beam_tokens, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_M=block_m, BLOCK_N=block_n, SPLITS=splits,
            SHARED=shared, BEAM=beam, OUT_PARTIAL=out_partial,
            FOR_LOOP=q.is_cuda,
            # float32 stays float32 on tensor cores (no tf32), so the engine stays exact.
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            num_warps=num_warps, num_stages=config.num_stages,
        )  # fmt: skip

    if two_stage:
        launch(shared=True, beam=False, out_partial=True)
        launch(shared=False, beam=True, out_partial=False)
    else:
        launch(shared=True, beam=True, out_partial=False)
    return out


def shared_decode_attention(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    beam_width: int,
    scale: float,
) -> torch.Tensor:
    """Attention of every beam over its request's shared KV alone, with no beam tokens:
    the cross-attention of an encoder-decoder (T5) over the encoder output, no mask.

    Args:
        q: (R * beam_width, num_heads, head_dim) fp16/bf16/fp32, one query per row.
        shared_k, shared_v: (total_prompt_tokens, num_kv_heads, head_dim) packed KV.
        cu_seqlens: (R + 1,) int32/int64 prompt offsets on the device.
        beam_width: query rows per request.
        scale: softmax scale (1.0 for T5).

    Returns:
        (R * beam_width, num_heads, head_dim) in q's dtype.

    Raises:
        ValueError: as ``beam_decode_attention``.
    """
    # The kernel's beam part reads no slot when num_beam_tokens is 0: one-row stand-ins,
    # left unwritten (zeroing them took two fill kernels a layer in the decode graphs).
    none_k = q.new_empty(1, 1, shared_k.shape[1], q.shape[2])
    none_rows = torch.empty(q.shape[0], 1, dtype=torch.int32, device=q.device)
    config = CROSS_ATTENTION_LAUNCH if q.shape[2] <= 64 else DEFAULT_LAUNCH
    return beam_decode_attention(
        q, shared_k, shared_v, cu_seqlens, none_k, none_k, none_rows, 0, beam_width, scale,
        config=config,
    )  # fmt: skip
