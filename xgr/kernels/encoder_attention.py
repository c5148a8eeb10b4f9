"""Bidirectional encoder self-attention with T5's relative position bias, over prompts padded
to one length: the torch reference of ``triton_encoder_attention``.

The bias depends on key - query alone, so it is given per offset (``offset_position_bias``:
2P - 1 values per head) rather than as a (heads, P, P) square; each prompt's padding keys
are masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def padded_biased_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    bias_by_offset: torch.Tensor,
    padded_len: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """Attention of each prompt's P query rows over its first ``lengths[s]`` keys.

    Args:
        q, k, v: (S * P, num_heads, head_dim), prompt-major: prompt s holds rows
            s * P .. s * P + P - 1 (the same number of KV heads as query heads, as T5).
        lengths: (S,) int prompt lengths, each in [1, P].
        bias_by_offset: (num_heads, 2 * P - 1) bias of key - query offset m - (P - 1).
        padded_len: P.
        scale: softmax scale (1.0 for T5, whose initialization folds it in).

    Returns:
        (S * P, num_heads, head_dim) in q's dtype; padding query rows attend like the others.
    """
    rows, heads, dim = q.shape
    slots = rows // padded_len
    pos = torch.arange(padded_len, device=q.device)
    square = bias_by_offset[:, pos[None, :] - pos[:, None] + padded_len - 1]  # (H, P, P)
    pad = torch.zeros(slots, padded_len, dtype=q.dtype, device=q.device)
    pad = pad.masked_fill(pos[None, :] >= lengths[:, None].to(q.device), float("-inf"))
    mask = square.to(q.dtype)[None] + pad[:, None, None, :]  # (S, H, P, P)
    qs, ks, vs = (t.view(slots, padded_len, heads, dim).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(rows, heads, dim)
