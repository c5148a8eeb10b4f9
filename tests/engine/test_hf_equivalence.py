"""The engine's beam search equals HF transformers' constrained beam search (the oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ARCHS, random_catalog, sequential_sid_map
from tests.hf_oracle import assert_same_semantic_ids, hf_constrained_beam_search
from xgr import Engine

NUM_LEVELS, CODEBOOK, OFFSET = 3, 16, 8


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beam_width", [8, 40])
def test_equals_hf_beam_search(model_dirs, arch, beam_width):
    catalog = random_catalog(600, NUM_LEVELS, CODEBOOK, seed=1)
    sid_map = sequential_sid_map(NUM_LEVELS, CODEBOOK, OFFSET)
    engine = Engine.from_pretrained(model_dirs[arch], catalog=catalog, sid_token_ids=sid_map)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(beam_width)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 23, 61)]
    search = dict(beam_width=beam_width, top_k=beam_width, num_results=beam_width)
    results = engine.recommend(prompts, **search)
    # Alone, at beam 40 (16 first-level codes) a request's level 1 runs within its prefill.
    assert engine.runner.first_levels_together(1, beam_width) == (beam_width == 40)
    results += [engine.recommend([prompt], **search)[0] for prompt in prompts]
    for prompt, result in zip(prompts * 2, results, strict=True):
        expected = hf_constrained_beam_search(hf, prompt, catalog, sid_map, beam_width)
        got = result.semantic_ids
        assert len(expected) == beam_width
        assert_same_semantic_ids(got, expected)
