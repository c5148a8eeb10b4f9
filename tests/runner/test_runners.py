"""The runners behind one interface: the family picked by the model, the first-levels
decision of each family, the padded shapes and what a prefill hands over."""

from __future__ import annotations

import torch

from xgr.kv import BeamKV
from xgr.models import CausalLM
from xgr.models.config import DecoderConfig, T5Config
from xgr.models.t5 import T5Seq2SeqLM
from xgr.runner import DecoderRunner, EncoderDecoderRunner, Prefilled, runner_for
from xgr.runner.shapes import packed_shape, padding_segments, slotted_shape


def decoder(dtype=torch.bfloat16):
    raw = dict(
        model_type="qwen2", vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512,
    )  # fmt: skip
    with torch.device("meta"):
        return CausalLM(DecoderConfig.from_hf(raw)).to(dtype)


def t5():
    raw = dict(
        model_type="t5", vocab_size=96, d_model=64, d_kv=16, d_ff=128, num_layers=2,
        num_heads=4, feed_forward_proj="relu", decoder_start_token_id=0,
    )  # fmt: skip
    with torch.device("meta"):
        return T5Seq2SeqLM(T5Config.from_hf(raw))


def test_the_runner_follows_the_model_family_and_its_prompt_limit():
    codes = torch.arange(16)
    dec, enc = runner_for(decoder(), 3, codes), runner_for(t5(), 3, codes)
    assert isinstance(dec, DecoderRunner) and isinstance(enc, EncoderDecoderRunner)
    assert dec.max_prompt_tokens == 512 - 3 + 1  # positions cover the generated codes
    assert enc.max_prompt_tokens == enc.model.config.max_prompt_tokens


def test_level_one_joins_the_pass_before_it_only_where_it_applies():
    codes = torch.arange(16)
    dec, enc = runner_for(decoder(), 3, codes), runner_for(t5(), 3, codes)
    # Every first-level code must fit the beam; a decoder-only batch must be one request.
    assert dec.first_levels_together(1, 16) and not dec.first_levels_together(1, 15)
    assert not dec.first_levels_together(2, 64)
    assert enc.first_levels_together(8, 16) and not enc.first_levels_together(8, 15)
    for runner in (runner_for(decoder(), 3, codes, first_levels_together=False),
                   runner_for(t5(), 3, codes, first_levels_together=False),
                   runner_for(decoder(), 1, codes), runner_for(t5(), 3, None)):  # fmt: skip
        assert not runner.first_levels_together(1, 64)


def test_packed_shapes_pad_to_buckets_and_stand_ins():
    one = packed_shape([100], 16, code_rows=16)
    assert (one.slots, one.padded_tokens, one.max_seqlen, one.code_rows) == (1, 256, 256, 16)
    several = packed_shape([30, 41, 7], 16)
    # The bound: a power of two over the longest prompt (41) and padding sequence (22).
    assert (several.slots, several.padded_tokens, several.max_seqlen) == (16, 256, 64)
    # The padding sequences: one per absent request, then the rest, each at least a token.
    seg, last = padding_segments(256 - 78, 13)
    assert seg >= 1 and last >= 1 and 13 * seg + last == 256 - 78
    assert decoder().lm_head.weight.dtype == torch.bfloat16
    assert runner_for(decoder(torch.float32), 3, None).prefill_shape([3, 4], 16, False) is None
    assert runner_for(decoder(), 3, None).prefill_shape([3, 4], 16, False) == packed_shape(
        [3, 4], 16
    )


def test_slotted_shapes_count_their_mask_bytes():
    shape = slotted_shape([30, 41, 100], 16, mask_bytes_per_square_token=8)
    assert (shape.slots, shape.slot_tokens, shape.padded_tokens) == (4, 128, 512)
    assert not shape.reads_positions and shape.workspace_bytes == 4 * 128 * 128 * 8


def test_prefilled_narrows_to_its_requests_and_copies_as_static_buffers():
    hidden, codes = torch.randn(4, 8), torch.randn(16, 8)
    kv = BeamKV.allocate(2, 16, 1, 2, 4, torch.float32, torch.device("cpu"))
    full = Prefilled(hidden, codes, kv)
    narrowed = full.narrow(1)
    assert narrowed.last_hidden.shape == (1, 8) and narrowed.code_hidden is codes
    assert narrowed.code_kv is kv
    static = full.like()
    assert [t.shape for t in static.tensors()] == [(4, 8), (16, 8)]
    assert static.last_hidden.data_ptr() != hidden.data_ptr() and static.code_kv is kv
    empty = Prefilled()  # an encoder's prefill hands over nothing but the shared K/V
    assert empty.tensors() == () and empty.narrow(3) is empty and empty.like().tensors() == ()
