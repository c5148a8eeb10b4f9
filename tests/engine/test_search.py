"""The search loop: decode levels on the live beams only (the row bound, and equality with
running every row), and level 1's forward inside the pass before it (an engine option) giving
the results of the steps one after the other."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from xgr import Engine, ItemCatalog
from xgr.engine import search as search_module

OFFSET = 8


def test_live_beam_widths_follow_the_catalog_and_the_search():
    # Level 0: codes {0, 1, 2}; prefixes of length 2: (0,0) (0,1) (0,2) (1,0) (1,1) (2,0) (2,3).
    codes = [[0, 0, 0], [0, 1, 0], [0, 2, 1], [1, 0, 0], [1, 1, 2], [2, 0, 0], [2, 3, 3], [0, 0, 1]]
    trie = ItemCatalog.from_codes([f"i{n}" for n in range(len(codes))], codes, 4).trie
    assert search_module.live_beam_widths(trie, beam_width=8, top_k=8) == [3, 7]
    assert search_module.live_beam_widths(trie, beam_width=4, top_k=4) == [3, 4]
    assert search_module.live_beam_widths(trie, beam_width=2, top_k=2) == [2, 2]
    # One candidate a beam: level 1 keeps at most as many beams as it had.
    assert search_module.live_beam_widths(trie, beam_width=8, top_k=1) == [3, 3]
    assert search_module.live_beam_widths(trie, beam_width=8, top_k=2) == [3, 6]


def full_rows(trie, beam_width, top_k):
    return [beam_width] * (len(trie.levels) - 1)


@pytest.mark.parametrize("arch", ["qwen3", "t5"])
def test_live_rows_give_the_results_of_every_row(model_dirs, tmp_path, monkeypatch, arch):
    # 16 first-level codes under a beam of 40: level 1's forward runs on 16 rows a request.
    catalog = random_catalog(700, 3, 16, seed=5)
    sid_map = sequential_sid_map(3, 16, OFFSET)
    if arch == "t5":
        write_random_t5(tmp_path, "gated-gelu", False, vocab_size=OFFSET + 48)
        folder = tmp_path
    else:
        folder = model_dirs[arch]
    engine = Engine.from_pretrained(folder, catalog=catalog, sid_token_ids=sid_map)
    assert search_module.live_beam_widths(engine.decode_spec.trie, 40, 40)[0] == 16
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(2, 56, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    search = dict(beam_width=40, top_k=40, num_results=40)
    live = engine.recommend(prompts, **search)
    monkeypatch.setattr(search_module, "live_beam_widths", full_rows)
    every = engine.recommend(prompts, **search)
    for got, want in zip(live, every, strict=True):
        assert [codes for codes, _ in got.semantic_ids] == [codes for codes, _ in want.semantic_ids]
        scores = torch.tensor([s for _, s in got.semantic_ids])
        expected = torch.tensor([s for _, s in want.semantic_ids])
        torch.testing.assert_close(scores, expected, rtol=0, atol=1e-5)


def first_levels_engines(arch, folder, model_dirs, num_levels):
    """Engines over a random catalog of ``num_levels`` x 16 codes (all 16 first codes): one
    that runs level 1's forward in the pass before it where it applies, one that never does."""
    catalog = random_catalog(150 * num_levels, num_levels, 16, seed=num_levels)
    sid_map = sequential_sid_map(num_levels, 16, OFFSET)
    if arch == "t5":
        write_random_t5(folder, "gated-gelu", False, vocab_size=OFFSET + 16 * num_levels, seed=7)
    else:
        folder = model_dirs[arch]
    engines = [
        Engine.from_pretrained(
            folder, catalog=catalog, sid_token_ids=sid_map, first_levels_together=together
        )
        for together in (True, False)
    ]
    first_codes = {codes[0] for codes in catalog.semantic_ids.tolist()}
    assert engines[0].decode_spec.first_codes.tolist() == sorted(first_codes)
    return engines


# (levels, beam width, top-k): every first-level code kept, top-k below the codebook, two
# and four levels.
FIRST_LEVEL_CASES = [(3, 40, 40), (3, 16, 5), (2, 20, 20), (4, 24, 8)]


def assert_same_results(got, want):
    for got_one, want_one in zip(got, want, strict=True):
        assert [c for c, _ in got_one.semantic_ids] == [c for c, _ in want_one.semantic_ids]
        scores = torch.tensor([s for _, s in got_one.semantic_ids])
        expected = torch.tensor([s for _, s in want_one.semantic_ids])
        # Scores of about -30 nats: a few float32 ulps apart (GEMMs of other row counts).
        torch.testing.assert_close(scores, expected, rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize(("num_levels", "beam_width", "top_k"), FIRST_LEVEL_CASES)
def test_t5_first_levels_in_one_pass_give_the_results_step_by_step(
    tmp_path, model_dirs, monkeypatch, num_levels, beam_width, top_k
):
    engine, apart = first_levels_engines("t5", tmp_path, model_dirs, num_levels)
    assert engine.runner.first_levels_together(3, beam_width)
    assert not apart.runner.first_levels_together(3, beam_width)
    passes = []
    for one in (engine, apart):
        together = one.model.decode_start_and_codes

        def counted(*args, together=together):
            passes.append(args[0].shape[0])
            return together(*args)

        monkeypatch.setattr(one.model, "decode_start_and_codes", counted)
    gen = torch.Generator().manual_seed(num_levels)
    vocab = OFFSET + 16 * num_levels
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (3, 17, 9)]
    search = dict(beam_width=beam_width, top_k=top_k, num_results=beam_width)
    got = engine.recommend(prompts, **search)
    first_codes = engine.decode_spec.first_codes.shape[0]
    assert passes == [3 * (1 + first_codes)]  # one pass: 3 requests' rows
    want = apart.recommend(prompts, **search)
    assert len(passes) == 1
    assert_same_results(got, want)


@pytest.mark.parametrize(("num_levels", "beam_width", "top_k"), FIRST_LEVEL_CASES)
def test_decoder_only_level_one_in_the_prefill_gives_the_results_step_by_step(
    tmp_path, model_dirs, monkeypatch, num_levels, beam_width, top_k
):
    engine, apart = first_levels_engines("qwen3", tmp_path, model_dirs, num_levels)
    assert engine.runner.first_levels_together(1, beam_width)
    assert not engine.runner.first_levels_together(2, beam_width)  # batches: apart
    assert not apart.runner.first_levels_together(1, beam_width)
    code_rows = []
    forward = type(engine.model).forward

    def counted(model, ids, positions, meta, embeds=None):
        code_rows.append(getattr(meta, "num_code_rows", None))
        return forward(model, ids, positions, meta, embeds)

    monkeypatch.setattr(type(engine.model), "forward", counted)
    gen = torch.Generator().manual_seed(num_levels)
    prompt = torch.randint(2, OFFSET + 16 * num_levels, (23,), generator=gen).tolist()
    search = dict(beam_width=beam_width, top_k=top_k, num_results=beam_width)
    got = engine.recommend([prompt], **search)
    # The prefill with 16 code rows, then one decode forward a later level.
    assert code_rows == [16] + [None] * (num_levels - 2)
    code_rows.clear()
    want = apart.recommend([prompt], **search)
    assert code_rows == [0] + [None] * (num_levels - 1)
    assert_same_results(got, want)


def test_first_levels_run_apart_when_the_beam_cannot_hold_every_first_code(model_dirs, tmp_path):
    catalog = random_catalog(300, 3, 16, seed=1)
    sid_map = sequential_sid_map(3, 16, OFFSET)
    write_random_t5(tmp_path, "relu", True, vocab_size=OFFSET + 48)
    t5 = Engine.from_pretrained(tmp_path, catalog=catalog, sid_token_ids=sid_map)
    first = t5.decode_spec.first_codes.shape[0]
    assert first == 16
    assert t5.runner.first_levels_together(4, first)
    assert not t5.runner.first_levels_together(1, first - 1)
    qwen = Engine.from_pretrained(model_dirs["qwen3"], catalog=catalog, sid_token_ids=sid_map)
    assert qwen.runner.first_levels_together(1, first)
    assert not qwen.runner.first_levels_together(1, first - 1)
