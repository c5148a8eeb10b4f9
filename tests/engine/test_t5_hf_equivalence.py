"""The engine's beam search over a T5 model equals HF transformers' (the oracle)."""

from __future__ import annotations

import pytest
import torch
from transformers import T5ForConditionalGeneration

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from tests.hf_oracle import assert_same_semantic_ids, hf_t5_constrained_beam_search
from xgr import Engine
from xgr.core import PromptTooLongError

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
        assert_same_semantic_ids(got, expected)


def test_t5_prompt_limit(tmp_path):
    write_random_t5(tmp_path, "relu", True, vocab_size=8 + NUM_LEVELS * CODEBOOK, n_positions=40)
    catalog = random_catalog(100, NUM_LEVELS, CODEBOOK, seed=2)
    sid_map = sequential_sid_map(NUM_LEVELS, CODEBOOK, 8)
    engine = Engine.from_pretrained(tmp_path, catalog=catalog, sid_token_ids=sid_map)
    # The decoder has positions of its own: the whole n_positions is the prompt's.
    assert engine.max_prompt_tokens == 40
    assert len(engine.recommend([[3] * 40], beam_width=4, top_k=4, num_results=2)[0].items) > 0
    with pytest.raises(PromptTooLongError, match="41 tokens"):
        engine.recommend([[3] * 41], beam_width=4, top_k=4, num_results=2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_t5_on_cuda_equals_the_cpu_reference(t5_dirs):
    variant = VARIANTS[1]
    catalog = random_catalog(600, NUM_LEVELS, CODEBOOK, seed=1)
    sid_map = sequential_sid_map(NUM_LEVELS, CODEBOOK, variant[2])
    cpu = Engine.from_pretrained(t5_dirs[variant], catalog=catalog, sid_token_ids=sid_map)
    gpu = Engine.from_pretrained(
        t5_dirs[variant], catalog=catalog, sid_token_ids=sid_map, device="cuda"
    )
    assert gpu.graphs is not None and gpu.attention_backend == "triton"  # cross-attention
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 56, (n,), generator=gen).tolist() for n in (5, 23, 61)]
    eager = Engine.from_pretrained(
        t5_dirs[variant], catalog=catalog, sid_token_ids=sid_map, device="cuda", cuda_graphs=False
    )
    search = dict(beam_width=32, top_k=32, num_results=32)
    want = cpu.recommend(prompts, **search)
    # The graph's capture, its replay on other prompts of the same batch shape, and eager.
    got = gpu.recommend(prompts, **search)
    replayed = gpu.recommend(prompts[::-1], **search)[::-1]
    assert gpu.graphs.captures == 2  # the encoder's graph and the decode levels' graph
    for results in (got, replayed, eager.recommend(prompts, **search)):
        for g, w in zip(results, want, strict=True):
            assert_same_semantic_ids(g.semantic_ids, w.semantic_ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_t5_bfloat16_on_cuda_keeps_the_top10_items(t5_dirs):
    """bf16 graphs + Triton cross-attention against the eager torch path, both bf16 on the
    GPU. A random-weight model's scores are nearly flat, so bf16 rounding alone reorders
    near-ties at the top-10 boundary: 0.85 was measured on the GPU; a wrong
    kernel or graph gives far less. The issue's 99% is measured on the trained demo models
    (``benchmarks/bf16_agreement.py``)."""
    variant = VARIANTS[2]  # TIGER-style: a vocabulary of the codes alone
    catalog = random_catalog(600, NUM_LEVELS, CODEBOOK, seed=9)
    sid_map = sequential_sid_map(NUM_LEVELS, CODEBOOK, variant[2])

    def load(**options):
        return Engine.from_pretrained(
            t5_dirs[variant], catalog=catalog, sid_token_ids=sid_map, device="cuda",
            dtype="bfloat16", **options,
        )  # fmt: skip

    graphed, reference = load(), load(cuda_graphs=False)
    reference.runner.attention_backend = "torch"
    gen = torch.Generator().manual_seed(10)
    lengths = torch.randint(3, 120, (100,), generator=gen).tolist()
    prompts = [torch.randint(2, 50, (n,), generator=gen).tolist() for n in lengths]

    def top10(engine):  # batches of 20: within the graphs' 64-request limit
        results = [
            r
            for i in range(0, len(prompts), 20)
            for r in engine.recommend(prompts[i : i + 20], beam_width=32, top_k=32, num_results=10)
        ]
        return [{c for c, _ in r.semantic_ids} for r in results]

    same = [a == b for a, b in zip(top10(graphed), top10(reference), strict=True)]
    print(f"T5 bf16: same top-10 set for {sum(same) / len(same):.2f} of the requests")
    assert sum(same) / len(same) >= 0.8
