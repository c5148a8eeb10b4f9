"""Causal attention over a batch of packed prompts of different lengths (prefill)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal self-attention within each prompt of a packed batch.

    Args:
        q: (total_tokens, num_heads, head_dim).
        k, v: (total_tokens, num_kv_heads, head_dim); num_heads % num_kv_heads == 0 (GQA).
        cu_seqlens: R + 1 host ints, token offsets of each prompt.
        scale: softmax scale.

    Returns:
        (total_tokens, num_heads, head_dim) in q's dtype.
    """
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        # SDPA wants [batch, heads, seq, dim].
        qs, ks, vs = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
        out[start:end] = o[0].transpose(0, 1)
    return out
