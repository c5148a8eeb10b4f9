"""A batch's inputs on the device: the packed layout (``prepare_inputs``) and the CUDA
graphs' staged one (``InputStaging``), which must hold the same values."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xgr.engine.inputs import PREFILL_PAD_TOKEN, InputStaging, prepare_inputs
from xgr.runner import PrefillShape
from xgr.runner.shapes import padding_segments


def shape(slots, padded, positions=True):
    return PrefillShape(slots, padded, padded, reads_positions=positions)


VIEWS = ("tokens", "positions", "last_index", "prompt_lens", "cu_seqlens", "cu_seqlens_int32")


def random_prompts(rng, num, longest=40):
    lens = rng.integers(1, longest, num).tolist()
    # Lists and int64 arrays, as the engine passes them.
    prompts = [
        rng.integers(0, 1000, n).tolist() if i % 2 else rng.integers(0, 1000, n)
        for i, n in enumerate(lens)
    ]
    return prompts, lens


@pytest.mark.parametrize("num", [1, 2, 3, 8])
def test_packed_views_match_the_prompts(num):
    prompts, lens = random_prompts(np.random.default_rng(num), num)
    inputs = prepare_inputs(prompts, torch.device("cpu"))
    cu = np.concatenate([[0], np.cumsum(lens)])
    assert inputs.cu_seqlens_host == cu.tolist()
    assert inputs.num_requests == num and inputs.num_tokens == cu[-1]
    assert inputs.max_seqlen == max(lens) and inputs.seqlens == lens
    assert inputs.prefill_key is None
    assert inputs.tokens.tolist() == np.concatenate([np.asarray(p) for p in prompts]).tolist()
    assert inputs.positions.tolist() == [t for n in lens for t in range(n)]
    assert inputs.last_index.tolist() == (cu[1:] - 1).tolist()
    assert inputs.prompt_lens.tolist() == lens
    assert inputs.cu_seqlens.tolist() == cu.tolist()
    assert inputs.cu_seqlens_int32.dtype == torch.int32
    assert inputs.cu_seqlens_int32.tolist() == cu.tolist()


@pytest.mark.parametrize(("padding", "stand_ins"), [(1, 0), (70, 62), (5000, 3), (300, 299)])
def test_padding_segments_cover_the_padding(padding, stand_ins):
    seg, last = padding_segments(padding, stand_ins)
    assert seg >= 1 or stand_ins == 0
    assert last >= 1 and seg * stand_ins + last == padding
    assert last <= seg + stand_ins + 1


@pytest.mark.parametrize("positions", [True, False], ids=["decoder-only", "encoder"])
def test_staged_inputs_equal_the_packed_ones_and_fill_the_graph_regions(positions):
    """Batches of several sizes through one buffer, the larger first, so every region a
    graph reads must be rewritten, not left from the batch before."""
    rng = np.random.default_rng(7)
    staging = InputStaging(max_requests=8, max_tokens=512, device=torch.device("cpu"))
    for num, slots, padded in ((8, 8, 512), (3, 8, 256), (1, 1, 64), (5, 8, 300)):
        prompts, lens = random_prompts(rng, num)
        total = sum(lens)
        key = shape(slots, padded, positions)
        staged = staging.stage(prompts, key)
        packed = prepare_inputs(prompts, torch.device("cpu"))
        assert staged.prefill_key == key
        assert staged.cu_seqlens_host == packed.cu_seqlens_host
        assert staged.max_seqlen == packed.max_seqlen
        for name in VIEWS:
            if name == "positions" and not positions:
                continue  # an encoder graph reads no positions
            got, want = getattr(staged, name), getattr(packed, name)
            assert got.dtype == want.dtype and torch.equal(got, want), (num, name)
        # What the graphs read beyond the batch's own values.
        assert staging.region("prompt_lens", slots)[num:].tolist() == [1] * (slots - num)
        assert staging.region("last_index", slots)[num:].tolist() == [0] * (slots - num)
        cu32 = staging.cu_seqlens_int32(slots + 2).tolist()
        seg, last = padding_segments(padded - total, slots - num)
        stand_in_ends = [total + seg * i for i in range(1, slots - num + 1)]
        assert cu32[num + 1 :] == [*stand_in_ends, padded]
        assert cu32[-1] - cu32[-2] == (last if slots > num else padded - total)
        if positions:
            tokens = staging.region("tokens", padded)
            assert tokens[total:].tolist() == [PREFILL_PAD_TOKEN] * (padded - total)
            assert staging.region("positions", padded, padded)[total:].abs().sum() == 0


def test_staging_refuses_a_batch_beyond_its_graph():
    staging = InputStaging(max_requests=4, max_tokens=128, device=torch.device("cpu"))
    with pytest.raises(ValueError, match="do not fit"):
        staging.stage([[1, 2, 3]] * 5, shape(4, 128))  # more prompts than slots
    with pytest.raises(ValueError, match="do not fit"):
        staging.stage([[1] * 100, [2] * 40], shape(4, 128))  # 140 tokens
    with pytest.raises(ValueError, match="do not fit"):
        staging.stage([[1]], shape(4, 256))  # a bucket above max_tokens
    with pytest.raises(ValueError, match="do not fit"):
        staging.stage([[1]], shape(8, 64))  # more slots than max_requests
    with pytest.raises(ValueError, match="absent prompt"):
        staging.stage([[1] * 10], shape(4, 13))  # 3 tokens of padding for 3 stand-ins
    with pytest.raises(ValueError, match="at least one"):
        staging.stage([], shape(4, 128))
    with pytest.raises(ValueError, match="at least one"):
        staging.stage([[1, 2], []], shape(4, 128))


def test_an_encoder_batch_is_staged_without_positions():
    staging = InputStaging(max_requests=4, max_tokens=128, device=torch.device("cpu"))
    staged = staging.stage([[1] * 10], shape(1, 10, positions=False))  # no padding
    assert staged.tokens.tolist() == [1] * 10
    with pytest.raises(ValueError, match="no positions"):
        _ = staged.positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("positions", [True, False])
def test_given_embeddings_travel_in_the_same_buffer_packed_and_staged(dtype, positions):
    """The spans' rows and each token's source row come in the batch's one buffer; a graph's
    view is the staging buffer's fixed-capacity one, the packed one sized to the batch."""
    hidden = 6  # 12 or 24 bytes a row: rows that do not fill whole int64 slots
    gen = torch.Generator().manual_seed(0)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    spans = [
        [(1, torch.randn(2, hidden, generator=gen).to(dtype))],
        [],
        [(0, torch.randn(2, hidden, generator=gen).to(dtype))],
    ]
    want_source = [-1, 0, 1, -1, -1, -1, -1, 2, 3]
    want_values = torch.cat([spans[0][0][1], spans[2][0][1]])
    packed = prepare_inputs(prompts, torch.device("cpu"), spans, hidden, dtype)
    assert packed.embeds.source.tolist() == want_source
    assert torch.equal(packed.embeds.values, want_values)
    assert packed.tokens.tolist() == [t for p in prompts for t in p]
    staging = InputStaging(4, 64, torch.device("cpu"), embed_tokens=32, hidden=hidden, dtype=dtype)
    shape = PrefillShape(4, 32, 32, reads_positions=positions, embeds=True)
    staged = staging.stage(prompts, shape, spans)
    graph_view = staging.embeds(32)
    assert graph_view.values.shape == (32, hidden)
    assert graph_view.source.tolist() == want_source + [-1] * (32 - 9)
    assert torch.equal(graph_view.values[:4], want_values)
    assert staged.embeds.source.data_ptr() == graph_view.source.data_ptr()
    assert staged.tokens.tolist() == [t for p in prompts for t in p]
    with pytest.raises(ValueError, match="above this staging buffer's 32"):
        staging.stage(
            prompts, PrefillShape(4, 48, 48, reads_positions=positions, embeds=True), spans
        )
