"""The engine's beam search over a T5 model equals HF transformers' (the oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers import T5ForConditionalGeneration

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from tests.hf_oracle import hf_t5_constrained_beam_search
from xgr import Engine

NUM_LEVELS, CODEBOOK = 3, 16
# (feed_forward_proj, tied head, vocabulary ids before the codes): text-and-code
# vocabularies, and the TIGER-style one of the codes alone (after pad = start and eos).
VARIANTS = [("relu", True, 8), ("gated-gelu", False, 8), ("gated-gelu", True, 2)]


@pytest.fixture(scope="module")
def t5_dirs(tmp_path_factory):
    dirs = {}
    for i, (proj, tied, offset) in enumerate(VARIANTS):
        path = tmp_path_factory.mktemp(f"t5-{proj}-{tied}-{offset}")
        write_random_t5(path, proj, tied, vocab_size=offset + NUM_LEVELS * CODEBOOK, seed=i)
        dirs[proj, tied, offset] = path
    return dirs


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v[0]}-tied{v[1]}-offset{v[2]}")
@pytest.mark.parametrize("beam_width", [8, 40])
def test_t5_equals_hf_beam_search(t5_dirs, variant, beam_width):
    proj, tied, offset = variant
    vocab = offset + NUM_LEVELS * CODEBOOK
    catalog = random_catalog(600, NUM_LEVELS, CODEBOOK, seed=1)
    sid_map = sequential_sid_map(NUM_LEVELS, CODEBOOK, offset)
    engine = Engine.from_pretrained(t5_dirs[variant], catalog=catalog, sid_token_ids=sid_map)
    hf = T5ForConditionalGeneration.from_pretrained(t5_dirs[variant], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(beam_width)
    # Prompt lengths below, inside and beyond the position buckets' max distance (24).
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (5, 23, 61)]
    results = engine.recommend(
        prompts, beam_width=beam_width, top_k=beam_width, num_results=beam_width
    )
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_t5_constrained_beam_search(hf, prompt, catalog, sid_map, beam_width)
        got = result.semantic_ids
        assert len(expected) == beam_width
        assert [codes for codes, _ in got] == [codes for codes, _ in expected]
        for (_, s_got), (_, s_exp) in zip(got, expected, strict=True):
            assert s_got == pytest.approx(s_exp, abs=1e-4)
