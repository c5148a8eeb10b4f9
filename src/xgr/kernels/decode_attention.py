"""Decode attention over a request's shared prompt KV plus each beam's unshared KV.

Attention runs in two stages whose partial results are merged exactly by log-sum-exp
(the online-softmax identity of Milakov & Gimelshein, "Online normalizer calculation for
softmax", 2018; the same merge FlashAttention and FlashInfer use for split KV):

1. every beam's query against its request's shared (prompt) KV, read once per request for
   all beams and all query heads of a KV head (one matrix product per request and KV head);
2. every beam's query against its own unshared KV (the tokens it generated).

This module is the torch reference: the CPU path, and the oracle for the GPU kernels.
"""

from __future__ import annotations

import torch


def shared_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: list[int],
    beam_width: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every beam's query against its request's shared KV.

    Args:
        q: (R * beam_width, num_heads, head_dim) queries, rows grouped by request.
        k, v: (total_prompt_tokens, num_kv_heads, head_dim) packed prompt KV.
        cu_seqlens: R + 1 host ints, the token offsets of each request's prompt.
        beam_width: beam rows per request.
        scale: softmax scale (usually head_dim ** -0.5).

    Returns:
        out: (R * beam_width, num_heads, head_dim) float32, softmax-weighted values.
        lse: (R * beam_width, num_heads) float32, log-sum-exp of the scaled scores.
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(rows, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.empty(rows, num_heads, dtype=torch.float32, device=q.device)
    for r in range(len(cu_seqlens) - 1):
        beams = slice(r * beam_width, (r + 1) * beam_width)
        # [Hkv, B * G, D]: all beams and all heads of a group share one read of the KV.
        qr = q[beams].float().view(beam_width, num_kv_heads, group, head_dim)
        qr = qr.permute(1, 0, 2, 3).reshape(num_kv_heads, beam_width * group, head_dim)
        kr = k[cu_seqlens[r] : cu_seqlens[r + 1]].float().transpose(0, 1)  # [Hkv, P, D]
        vr = v[cu_seqlens[r] : cu_seqlens[r + 1]].float().transpose(0, 1)
        scores = torch.matmul(qr, kr.transpose(1, 2)) * scale  # [Hkv, B * G, P]
        lse_r = torch.logsumexp(scores, dim=-1)
        out_r = torch.matmul(torch.exp(scores - lse_r[..., None]), vr)  # [Hkv, B * G, D]
        out[beams] = (
            out_r.view(num_kv_heads, beam_width, group, head_dim)
            .permute(1, 0, 2, 3)
            .reshape(beam_width, num_heads, head_dim)
        )
        lse[beams] = (
            lse_r.view(num_kv_heads, beam_width, group)
            .permute(1, 0, 2)
            .reshape(beam_width, num_heads)
        )
    return out, lse


def unshared_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every beam's query against its own generated tokens.

    Args:
        q: (N, num_heads, head_dim) queries.
        k, v: (N, T, num_kv_heads, head_dim) each beam's unshared KV, T >= 1 tokens.
        scale: softmax scale.

    Returns:
        out: (N, num_heads, head_dim) float32; lse: (N, num_heads) float32.
    """
    rows, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    qg = q.float().view(rows, num_kv_heads, group, head_dim)
    scores = torch.einsum("nhgd,nthd->nhgt", qg, k.float()) * scale
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("nhgt,nthd->nhgd", torch.exp(scores - lse[..., None]), v.float())
    return out.reshape(rows, num_heads, head_dim), lse.reshape(rows, num_heads)


def merge_attention_states(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax over the union of two disjoint key sets from their partial results.

    Args:
        out_a, out_b: (..., head_dim) float32 partial outputs.
        lse_a, lse_b: (...) float32 log-sum-exp of each part's scores (-inf for an empty part).

    Returns:
        out: (..., head_dim) float32; lse: (...) float32 of the union.
    """
    lse = torch.logaddexp(lse_a, lse_b)
    weight_a = torch.exp(lse_a - lse)[..., None]
    weight_b = torch.exp(lse_b - lse)[..., None]
    return out_a * weight_a + out_b * weight_b, lse


def decode_attention_reference(
    q: torch.Tensor,
    shared_k: torch.Tensor,
    shared_v: torch.Tensor,
    cu_seqlens: list[int],
    beam_k: torch.Tensor,
    beam_v: torch.Tensor,
    beam_width: int,
    scale: float,
) -> torch.Tensor:
    """Staged decode attention: shared prompt KV, then unshared beam KV, merged by LSE.

    Args:
        q: (R * beam_width, num_heads, head_dim) one query per beam.
        shared_k, shared_v: (total_prompt_tokens, num_kv_heads, head_dim) packed prompt KV.
        cu_seqlens: R + 1 host ints, prompt offsets.
        beam_k, beam_v: (R * beam_width, T, num_kv_heads, head_dim) beams' own KV, T >= 1
            (the current token's KV already written).
        beam_width: beams per request.
        scale: softmax scale.

    Returns:
        (R * beam_width, num_heads, head_dim) in q's dtype.
    """
    out_s, lse_s = shared_attention_reference(q, shared_k, shared_v, cu_seqlens, beam_width, scale)
    out_u, lse_u = unshared_attention_reference(q, beam_k, beam_v, scale)
    out, _ = merge_attention_states(out_s, lse_s, out_u, lse_u)
    return out.to(q.dtype)
