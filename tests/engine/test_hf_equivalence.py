"""The engine's beam search equals HF transformers' constrained beam search (the oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conftest import ARCHS, random_catalog, sequential_sid_map
from xgr import Engine

NUM_LEVELS, CODEBOOK, OFFSET = 3, 16, 8


def hf_constrained_beam_search(model, prompt, catalog, sid_map, beam_width):
    """HF generate with the catalog trie as prefix_allowed_tokens_fn -> [(codes, score)]."""
    allowed: dict[tuple[int, ...], set[int]] = {}
    for row in catalog.semantic_ids.tolist():
        tokens = [int(sid_map[level, code]) for level, code in enumerate(row)]
        for depth in range(NUM_LEVELS):
            allowed.setdefault(tuple(tokens[:depth]), set()).add(tokens[depth])
    any_level = {d: sorted(set(sid_map[d].tolist())) for d in range(NUM_LEVELS)}

    def prefix_fn(batch_id, input_ids):
        generated = tuple(input_ids[len(prompt) :].tolist())
        # Beams HF keeps only as padding (score -1e9 or -inf) may hold invalid prefixes.
        return sorted(allowed.get(generated, any_level[len(generated)]))

    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        num_beams=beam_width,
        num_return_sequences=beam_width,
        do_sample=False,
        length_penalty=0.0,
        max_new_tokens=NUM_LEVELS,
        prefix_allowed_tokens_fn=prefix_fn,
        output_scores=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        eos_token_id=None,
    )
    token_to_code = {int(sid_map[d, c]): c for d in range(NUM_LEVELS) for c in range(CODEBOOK)}
    results = []
    for seq, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        if score < -1e8:  # HF's filler beams when fewer valid paths than beams exist
            continue
        results.append((tuple(token_to_code[t] for t in seq[len(prompt) :]), score))
    return results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("beam_width", [8, 40])
def test_equals_hf_beam_search(model_dirs, arch, beam_width):
    catalog = random_catalog(600, NUM_LEVELS, CODEBOOK, seed=1)
    sid_map = sequential_sid_map(NUM_LEVELS, CODEBOOK, OFFSET)
    engine = Engine.from_pretrained(model_dirs[arch], catalog=catalog, sid_token_ids=sid_map)
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(beam_width)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 23, 61)]
    results = engine.recommend(
        prompts, beam_width=beam_width, top_k=beam_width, num_results=beam_width
    )
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_constrained_beam_search(hf, prompt, catalog, sid_map, beam_width)
        got = result.semantic_ids
        assert len(expected) == beam_width
        assert [codes for codes, _ in got] == [codes for codes, _ in expected]
        for (_, s_got), (_, s_exp) in zip(got, expected, strict=True):
            assert s_got == pytest.approx(s_exp, abs=1e-4)
