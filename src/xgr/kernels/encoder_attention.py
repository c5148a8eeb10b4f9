"""Bidirectional encoder self-attention with T5's relative position bias, over prompts padded
to one length: the torch reference of ``triton_encoder_attention``.

The bias depends on key - query alone, so it is given per offset (``offset_position_bias``:
2P - 1 values per head) rather than as a (heads, P, P) square; each prompt's padding keys
are masked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def square_from_offsets(per_offset: torch.Tensor, length: int) -> torch.Tensor:
    """The (num_heads, length, length) bias of queries 0..length-1 over the same keys from
    its (num_heads, 2 * length - 1) per-offset values (``relative_position``'s
    ``offset_position_bias``), by one copy.

    Returns:
        (num_heads, length, length) contiguous, in per_offset's dtype.
    """
    per_offset = per_offset.contiguous()
    # view[h, a, j] = per_offset[h, a + j]; row a = length - 1 - i holds query i (offset j - i).
    view = per_offset.as_strided((per_offset.shape[0], length, length), (2 * length - 1, 1, 1))
    return view.flip(1)


def square_mask(
    lengths: torch.Tensor, bias_by_offset: torch.Tensor, padded_len: int, dtype: torch.dtype
) -> torch.Tensor:
    """The additive mask SDPA takes: each prompt's (heads, P, P) position bias, and -inf at
    its padding keys.

    Args:
        lengths: (S,) int prompt lengths, each in [1, P].
        bias_by_offset: (num_heads, 2 * P - 1) bias of key - query offset m - (P - 1).
        padded_len: P. dtype: the mask's dtype (the queries').

    Returns:
        (S, num_heads, P, P) in ``dtype``.
    """
    device = bias_by_offset.device
    pos = torch.arange(padded_len, device=device)
    square = square_from_offsets(bias_by_offset, padded_len)  # (H, P, P)
    pad = torch.zeros(lengths.shape[0], padded_len, dtype=dtype, device=device)
    pad = pad.masked_fill(pos[None, :] >= lengths[:, None].to(device), float("-inf"))
    return square.to(dtype)[None] + pad[:, None, None, :]


def padded_biased_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    bias_by_offset: torch.Tensor,
    padded_len: int,
) -> torch.Tensor:
    """Attention of each prompt's P query rows over its first ``lengths[s]`` keys, softmax
    scale 1 (T5's initialization folds the usual 1 / sqrt(d) in).

    Args:
        q, k, v: (S * P, num_heads, head_dim), prompt-major: prompt s holds rows
            s * P .. s * P + P - 1 (the same number of KV heads as query heads, as T5).
        lengths: (S,) int prompt lengths, each in [1, P].
        bias_by_offset: (num_heads, 2 * P - 1) bias of key - query offset m - (P - 1).
        padded_len: P.

    Returns:
        (S * P, num_heads, head_dim) in q's dtype; padding query rows attend like the others.
    """
    rows, heads, dim = q.shape
    slots = rows // padded_len
    mask = square_mask(lengths, bias_by_offset, padded_len, q.dtype)
    qs, ks, vs = (t.view(slots, padded_len, heads, dim).transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=1.0)
    return out.transpose(1, 2).reshape(rows, heads, dim)
