"""Per-level scores: each level's code log-probability equals the model's, teacher-forced
along the returned semantic ID, and the levels sum to the beam's score."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from xgr import Engine

LEVELS, CODEBOOK, OFFSET = 3, 16, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def float32_sum(values) -> float:
    """The levels summed in order in float32, as the search adds them."""
    total = np.float32(0.0)
    for v in values:
        total = np.float32(total + np.float32(v))
    return float(total)


def teacher_forced(log_probs_of, prompt, codes, sid_map) -> list[float]:
    """Each level's log-probability of ``codes`` after ``prompt`` (full-vocabulary softmax)."""
    tokens = [int(sid_map[level, code]) for level, code in enumerate(codes)]
    log_probs = log_probs_of(prompt, tokens)  # (levels, vocab)
    return [float(log_probs[level, t]) for level, t in enumerate(tokens)]


def decoder_log_probs(model):
    def log_probs_of(prompt, tokens):
        ids = torch.tensor([prompt + tokens[:-1]])
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1 :].float()
        return torch.log_softmax(logits, -1)

    return log_probs_of


def t5_log_probs(model):
    start = model.config.decoder_start_token_id

    def log_probs_of(prompt, tokens):
        with torch.no_grad():
            logits = (
                model(
                    input_ids=torch.tensor([prompt]),
                    decoder_input_ids=torch.tensor([[start, *tokens[:-1]]]),
                )
                .logits[0]
                .float()
            )
        return torch.log_softmax(logits, -1)

    return log_probs_of


def check_level_scores(result, prompt, log_probs_of, sid_map):
    assert result.semantic_ids and len(result.level_scores) == len(result.semantic_ids)
    for (codes, score), levels in zip(result.semantic_ids, result.level_scores, strict=True):
        assert len(levels) == LEVELS
        assert float32_sum(levels) == pytest.approx(score, abs=1e-6)
        np.testing.assert_allclose(
            levels, teacher_forced(log_probs_of, prompt, codes, sid_map), rtol=0, atol=1e-4
        )
    by_codes = dict(zip([c for c, _ in result.semantic_ids], result.level_scores, strict=True))
    for item in result.items:
        assert item.level_scores == by_codes[item.semantic_id]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("beam_width", [8, 40])
def test_decoder_level_scores(model_dirs, device, arch, beam_width):
    catalog = random_catalog(600, LEVELS, CODEBOOK, seed=1)
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    engine = Engine.from_pretrained(
        model_dirs[arch], catalog=catalog, sid_token_ids=sid_map, device=device,
        dtype=torch.float32,
    )  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(beam_width)
    prompts = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (5, 23)]
    search = dict(beam_width=beam_width, top_k=beam_width, num_results=beam_width)
    # Alone at beam 40 (16 first-level codes) level 1 runs within the prefill; batched not.
    results = engine.recommend(prompts, **search) + engine.recommend(prompts[:1], **search)
    # With rules the search takes the masked path.
    results += engine.recommend(prompts[:1], **search, exclude_item_ids=[catalog.item_ids[:50]])
    for prompt, result in zip([*prompts, prompts[0], prompts[0]], results, strict=True):
        check_level_scores(result, prompt, decoder_log_probs(hf), sid_map)


@pytest.mark.parametrize("device", DEVICES)
def test_t5_level_scores(tmp_path, device):
    write_random_t5(tmp_path, "gated-gelu", False, vocab_size=OFFSET + LEVELS * CODEBOOK, seed=4)
    catalog = random_catalog(600, LEVELS, CODEBOOK, seed=2)
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    engine = Engine.from_pretrained(
        tmp_path, catalog=catalog, sid_token_ids=sid_map, device=device, dtype=torch.float32
    )
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = [3, 9, 14, 20, 31, 40, 11]
    for beam_width in (8, 40):
        (result,) = engine.recommend(
            [prompt], beam_width=beam_width, top_k=beam_width, num_results=beam_width
        )
        check_level_scores(result, prompt, t5_log_probs(hf), sid_map)
