"""Which CUDA graph a batch replays: the padded token buckets of prefill graphs and the
prompt slots of encoder graphs (``xgr.engine.cuda_graph``)."""

from __future__ import annotations

from xgr.engine.inputs import padding_segments

PREFILL_BUCKET = 256
BUCKETS_PER_OCTAVE = 8
# An encoder graph pads its prompts to one length P; under SDPA its attention mask (S x heads
# x P x P, model dtype) is the graph's largest buffer. Encodes whose mask would pass this run
# eagerly (the Triton encoder attention, the default, builds no mask).
MAX_ENCODER_MASK_BYTES = 1 << 30
ENCODER_BUCKET = 64


def prefill_bucket(num_tokens: int) -> int:
    """Padded token count of a prefill graph: above num_tokens (one padding token at least).

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


def encode_key(model, num: int, max_len: int, max_requests: int, max_tokens: int) -> tuple | None:
    """("encode", slots, slots * P, P) of an encoder graph over ``num`` prompts, the longest
    ``max_len`` tokens: a power-of-two number of prompt slots (at most ``max_requests``),
    each padded to P = ``encoder_bucket`` tokens; None (eager) past ``max_tokens`` padded
    tokens, or past ``MAX_ENCODER_MASK_BYTES`` where ``model`` (a ``T5Seq2SeqLM``) builds
    SDPA's square mask."""
    slots = min(next_power_of_two(num), max_requests)
    length = encoder_bucket(max_len)
    weight = model.lm_head.weight
    mask_bytes = slots * model.config.num_heads * length**2 * weight.element_size()
    too_large = mask_bytes > MAX_ENCODER_MASK_BYTES and model.encoder_builds_mask(weight.device)
    if slots * length > max_tokens or too_large:
        return None
    return "encode", slots, slots * length, length


def padded_shape(total: int, num: int, max_seqlen: int, max_requests: int) -> tuple[int, int, int]:
    """(request slots, padded tokens, max sequence length) of a decoder-only prefill graph
    over ``num`` prompts of ``total`` tokens, the longest ``max_seqlen``: one request runs
    alone in its bucket; several take ``max_requests`` slots, the missing ones stand-in
    sequences of the padding."""
    if num == 1:
        padded = prefill_bucket(total)
        return 1, padded, padded
    slots = max_requests
    padded = prefill_bucket(total + slots - num)
    _, longest = padding_segments(padded - total, slots - num)
    # A power of two: the bound is a graph key, and few keys cover any batch.
    return slots, padded, next_power_of_two(max(max_seqlen, longest))
