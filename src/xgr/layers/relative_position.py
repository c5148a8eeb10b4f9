"""T5's relative position bias: a learned scalar per head and bucket of key - query offset.

Relative position representations come from Shaw et al. 2018, "Self-Attention with Relative
Position Representations"; T5 (Raffel et al. 2020, "Exploring the Limits of Transfer Learning
with a Unified Text-to-Text Transformer", section 2.1) reduces them to one learned bias per
head added to the attention logits, shared by all layers of a stack, with offsets binned into
buckets: half of a direction's buckets are exact offsets 0, 1, ..., the other half cover
offsets up to ``max_distance`` in logarithmically growing bins, and farther offsets share the
last bucket. The encoder tells the two directions apart (half the buckets each); the decoder
sees only keys at or before the query, so all buckets go to backward offsets.
"""

from __future__ import annotations

import math

import torch

from xgr.kernels.encoder_attention import square_from_offsets


def relative_position_bucket(
    relative_position: torch.Tensor, bidirectional: bool, num_buckets: int, max_distance: int
) -> torch.Tensor:
    """Bucket index of each key - query offset.

    Args:
        relative_position: int64 tensor of key position minus query position, any shape.
        bidirectional: True for the encoder (offsets > 0 get buckets of their own); False for
            the causal decoder (offsets > 0 cannot occur and share the bucket of 0).
        num_buckets: buckets in all (the config's ``relative_attention_num_buckets``).
        max_distance: offsets this far or farther share the last bucket of their direction;
            more than num_buckets // 2 (checked by ``T5Config.from_hf``).

    Returns:
        int64 tensor of the same shape, values in [0, num_buckets).
    """
    if bidirectional:
        num_buckets //= 2
        base = (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        base = torch.zeros_like(relative_position)
        distance = (-relative_position).clamp(min=0)
    exact = num_buckets // 2
    # Offsets below ``exact`` are their own bucket; the clamp only keeps log() finite for
    # them, their log bucket is never used.
    log_ratio = torch.log(distance.clamp(min=1).float() / exact) / math.log(max_distance / exact)
    far = exact + (log_ratio * (num_buckets - exact)).long()
    far = far.clamp(max=num_buckets - 1)
    return base + torch.where(distance < exact, distance, far)


def relative_position_bias(
    table: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    bidirectional: bool,
    max_distance: int,
) -> torch.Tensor:
    """The additive attention bias of every (query, key) pair.

    Args:
        table: (num_buckets, num_heads) learned bias per bucket and head (the weight of a
            ``relative_attention_bias`` embedding), model dtype.
        query_positions: (Q,) int64 positions of the queries.
        key_positions: (K,) int64 positions of the keys.
        bidirectional, max_distance: as in ``relative_position_bucket``.

    Returns:
        (num_heads, Q, K) in the table's dtype.
    """
    offsets = key_positions[None, :] - query_positions[:, None]  # [Q, K]
    buckets = relative_position_bucket(offsets, bidirectional, table.shape[0], max_distance)
    # Contiguous: a permuted view has last stride num_heads, which the Triton kernels refuse
    # and which, as an attention mask, sends PyTorch's SDPA to its float32 math path (7 ms for
    # a 1k-token OneRec-size encoder on the GPU).
    return table[buckets].permute(2, 0, 1).contiguous()


def square_position_bias(
    table: torch.Tensor, length: int, bidirectional: bool, max_distance: int
) -> torch.Tensor:
    """``relative_position_bias`` of positions 0..length-1 over themselves, built from the
    2 * length - 1 distinct offsets instead of length^2 bucket lookups.

    The bias depends on key - query alone (a Toeplitz matrix): the per-offset biases are
    viewed with strides that walk them diagonally, and one copy (the flip) lays the square
    out. The length^2 bucket arithmetic and gather took about 1 ms of a 1k-token
    OneRec-size encoder on the GPU.

    Returns:
        (num_heads, length, length) contiguous, in the table's dtype.
    """
    per_offset = offset_position_bias(table, length, bidirectional, max_distance)
    return square_from_offsets(per_offset, length)


def offset_position_bias(
    table: torch.Tensor, length: int, bidirectional: bool, max_distance: int
) -> torch.Tensor:
    """The bias of each key - query offset between positions 0..length-1.

    Returns:
        (num_heads, 2 * length - 1) contiguous, in the table's dtype: column m holds offset
        m - (length - 1).
    """
    offsets = torch.arange(1 - length, length, device=table.device)
    buckets = relative_position_bucket(offsets, bidirectional, table.shape[0], max_distance)
    return table[buckets].T.contiguous()
