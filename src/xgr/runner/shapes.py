"""The padded shape of a prefill that a CUDA graph replays (``PrefillShape``), and the token
buckets it pads to: prompts of any lengths with the same padded shape reuse one graph."""

from __future__ import annotations

from dataclasses import dataclass

PREFILL_BUCKET = 256
BUCKETS_PER_OCTAVE = 8
ENCODER_BUCKET = 64


@dataclass(frozen=True)
class PrefillShape:
    """A padded prefill: the key of its CUDA graph, and the layout its inputs are staged in.

    Attributes:
        slots: request slots; a batch of fewer requests fills the rest with stand-ins.
        padded_tokens: P, the tokens the graph runs (the prompts packed from the start,
            then padding).
        max_seqlen: the longest sequence the attention sees (tokens): a decoder-only
            graph's bound on its packed attention's grid.
        slot_tokens: an encoder graph pads each prompt to this many tokens (its slots are
            ``padded_tokens / slot_tokens``); 0 for a packed decoder-only prefill.
        reads_positions: the graph reads a position per token (decoder-only models).
        code_rows: rows after the prompt that run level 1's forward in the same pass (one a
            first-level code of the catalog); 0 where level 1 runs after level 0.
        workspace_bytes: the largest buffer the graph's attention builds beyond the KV
            (an encoder's SDPA mask), bytes; 0 for none.
        embeds: the graph splices given input embeddings over some tokens' (a batch with
            ``xgr.Prompt`` spans); any number of them, up to every token.
    """

    slots: int
    padded_tokens: int
    max_seqlen: int
    slot_tokens: int = 0
    reads_positions: bool = True
    code_rows: int = 0
    workspace_bytes: int = 0
    embeds: bool = False


def prefill_bucket(num_tokens: int) -> int:
    """Padded token count of a packed prefill graph: above num_tokens (one padding token at
    least).

    Multiples of max(PREFILL_BUCKET, 2**floor(log2 n) / BUCKETS_PER_OCTAVE): padding is at
    most an eighth of a long prefill, and the buckets up to 64k tokens number about 50.
    """
    step = _bucket_step(num_tokens, PREFILL_BUCKET)
    return (num_tokens // step + 1) * step


def encoder_bucket(max_len: int) -> int:
    """Padded prompt length (tokens) of an encoder graph: at least ``max_len``, a multiple
    of max(ENCODER_BUCKET, 2**floor(log2 max_len) / BUCKETS_PER_OCTAVE)."""
    step = _bucket_step(max_len, ENCODER_BUCKET)
    return -(-max_len // step) * step


def _bucket_step(n: int, smallest: int) -> int:
    """Bucket spacing near n: 2**floor(log2 n) / BUCKETS_PER_OCTAVE, at least ``smallest``."""
    return max(smallest, (1 << max(n.bit_length() - 1, 0)) // BUCKETS_PER_OCTAVE)


def next_power_of_two(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def padding_segments(padding: int, stand_ins: int) -> tuple[int, int]:
    """Lengths of a packed prefill's padding sequences: ``stand_ins`` of the first value (the
    absent requests), then one of the second (the rest); padding > stand_ins tokens.

    Spreading the padding keeps every sequence short, so the attention's max-length bound
    (and with it the grid) follows the real prompts.
    """
    seg = padding // (stand_ins + 1)
    return seg, padding - stand_ins * seg


def packed_shape(prompt_lens: list[int], max_requests: int, code_rows: int = 0) -> PrefillShape:
    """The padded shape of a decoder-only prefill over prompts of these lengths (tokens).

    One request runs alone in its bucket (a causal pass over the whole buffer: padding
    last changes nothing before it); several take ``max_requests`` slots, the missing ones
    stand-in sequences of the padding, so that one graph serves every batch size and the
    packed attention launch keeps the sequences apart by their device offsets.
    """
    total, num = sum(prompt_lens), len(prompt_lens)
    if num == 1:
        padded = prefill_bucket(total)
        return PrefillShape(1, padded, padded, code_rows=code_rows)
    padded = prefill_bucket(total + max_requests - num)
    _, longest = padding_segments(padded - total, max_requests - num)
    # A power of two: the bound is part of the key, and few keys cover any batch.
    max_seqlen = next_power_of_two(max(max(prompt_lens), longest))
    return PrefillShape(max_requests, padded, max_seqlen, code_rows=code_rows)


def slotted_shape(
    prompt_lens: list[int], max_requests: int, mask_bytes_per_square_token: int = 0
) -> PrefillShape:
    """The padded shape of an encoder prefill: a power-of-two number of prompt slots (at
    most ``max_requests``), each padded to ``encoder_bucket`` tokens of the longest prompt.

    Args:
        mask_bytes_per_square_token: bytes of the attention mask per slot and (token,
            token) pair where the encoder builds one (heads x element size), else 0.
    """
    slots = min(next_power_of_two(len(prompt_lens)), max_requests)
    length = encoder_bucket(max(prompt_lens))
    mask = slots * length * length * mask_bytes_per_square_token
    return PrefillShape(
        slots, slots * length, length, slot_tokens=length, reads_positions=False,
        workspace_bytes=mask,
    )  # fmt: skip
