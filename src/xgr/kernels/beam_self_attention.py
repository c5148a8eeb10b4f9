"""Self-attention of each beam's newest token over the beam's own tokens, with an additive
per-head position bias: the decoder self-attention of an encoder-decoder (T5) in xgr's KV
layout, where a beam's tokens live in ``BeamKV`` slots reached through its ancestry index.

A step writes each beam's new K/V into slot ``length`` of its row, then attends over slots
0..length (at most one per semantic-ID level plus the start token). This module is the torch
reference: the CPU path, and the oracle for ``triton_beam_self_attention``.
"""

from __future__ import annotations

import torch


def beam_self_attention_reference(
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
    """Write the newest token's K/V, then attend over the beam's slots 0..slot.

    Scores are q . k + bias with no 1 / sqrt(d) scale (T5 folds it into its weights); the
    softmax and weighted sum run in float32.

    Args:
        q, k_new, v_new: (N, num_heads, head_dim), model dtype, one row per query.
        beam_k, beam_v: (rows, capacity, num_heads, head_dim) one layer's beam K/V, model
            dtype; slot ``slot`` of row ``kv_rows[n]`` receives k_new[n] / v_new[n].
        beam_rows: (rows, capacity) int32 ancestry index (``BeamKV.rows``); column
            ``slot`` is the identity (not yet written).
        kv_rows: (N,) int64, the row each query writes and reads through.
        slot: slots already written (``BeamKV.length``).
        bias: (num_heads, slot + 1) position bias of the query over slots 0..slot.

    Returns:
        (N, num_heads, head_dim) in q's dtype.
    """
    beam_k[kv_rows, slot] = k_new
    beam_v[kv_rows, slot] = v_new
    rows = beam_rows[kv_rows, : slot + 1].long()  # [N, S]
    slots = torch.arange(slot + 1, device=rows.device)[None, :]
    own_k, own_v = beam_k[rows, slots], beam_v[rows, slots]  # [N, S, H, D]
    scores = torch.einsum("nhd,nshd->nhs", q.float(), own_k.float()) + bias.float()
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("nhs,nshd->nhd", probs, own_v.float()).to(q.dtype)


def start_and_codes_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
    rows_per_request: int,
    bias: torch.Tensor,
) -> torch.Tensor:
    """Decoder self-attention of a pass over each request's start token and its candidate
    first codes, one position after it (``T5Seq2SeqLM.decode_start_and_codes``).

    Rows are request-major, P = ``rows_per_request`` a request: row r * P holds request r's
    decoder start token (position 0), rows r * P + 1 .. r * P + P - 1 each one candidate
    code at position 1. Row n writes its K/V into beam row n, slot 0 for a start token and
    slot 1 for a code. A start token attends to itself alone, so its output is its value; a
    code attends over its request's start token and itself. Scores are q . k + bias with
    no 1 / sqrt(d) scale (T5); the softmax and weighted sum run in float32.

    Args:
        q, k, v: (N, num_heads, head_dim), model dtype, N a multiple of P.
        beam_k, beam_v: (rows, capacity, num_heads, head_dim) one layer's beam K/V, model
            dtype, rows >= N and capacity >= 2.
        rows_per_request: P >= 1.
        bias: (num_heads, 2) position bias of a query at position 1 over positions 0, 1.

    Returns:
        (N, num_heads, head_dim) in q's dtype.
    """
    rows = torch.arange(q.shape[0], device=q.device)
    first = rows % rows_per_request == 0
    slot = (~first).long()
    beam_k[rows, slot] = k
    beam_v[rows, slot] = v
    start = rows - rows % rows_per_request
    qf, kf, vf = q.float(), k.float(), v.float()
    scores = (
        torch.stack([(qf * kf[start]).sum(-1), (qf * kf).sum(-1)], dim=-1) + bias.float()
    )  # [N, H, 2]
    probs = torch.softmax(scores, dim=-1)
    out = probs[..., :1] * vf[start] + probs[..., 1:] * vf
    return torch.where(first[:, None, None], vf, out).to(q.dtype)
