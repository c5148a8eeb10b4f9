"""Prompts with given input embeddings (``xgr.Prompt``): the search equals HF transformers'
``generate(inputs_embeds=...)`` with the same embeddings, batches mixing them with plain
prompts equal each prompt alone, and bad spans are refused by name."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, T5ForConditionalGeneration

from tests.conftest import random_catalog, sequential_sid_map, write_random_t5
from tests.hf_oracle import (
    assert_same_semantic_ids,
    hf_constrained_beam_search,
    hf_constrained_beam_search_embeds,
    hf_t5_constrained_beam_search,
)
from xgr import Engine, Prompt, XgrError
from xgr.engine.prompt_embeds import largest_magnitude

LEVELS, CODEBOOK, OFFSET = 3, 16, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def prompts_for(embedding: torch.nn.Embedding, seed: int, vocab_base: int):
    """A prompt with two spans, one made only of embeddings, and plain token ids; with the
    input embeddings each stands for (what HF is given)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = embedding.weight.shape[1]
    scale = float(embedding.weight.detach().float().std())

    def rows(n):
        return torch.randn(n, hidden, generator=gen) * scale

    ids = torch.randint(0, vocab_base, (23,), generator=gen).tolist()
    spans = [(10, rows(5)), (2, rows(3).numpy())]  # out of order, NumPy and torch
    whole = rows(9)
    plain = torch.randint(0, vocab_base, (14,), generator=gen).tolist()
    with torch.no_grad():
        mixed = embedding(torch.tensor(ids, device=embedding.weight.device)).float().cpu()
    for offset, values in spans:
        values = torch.as_tensor(values)
        mixed[offset : offset + values.shape[0]] = values
    prompts = [Prompt(token_ids=ids, embeds=spans), Prompt(embeds=whole), plain]
    return prompts, [mixed, whole, plain]


def check_against_hf(engine, prompts, hf_inputs, oracle, beam_width):
    search = dict(beam_width=beam_width, top_k=beam_width, num_results=beam_width)
    batched = engine.recommend(prompts, **search)
    alone = [engine.recommend([p], **search)[0] for p in prompts]
    for got_batched, got_alone, hf_input in zip(batched, alone, hf_inputs, strict=True):
        expected = oracle(hf_input)
        assert len(expected) == beam_width
        assert_same_semantic_ids(got_alone.semantic_ids, expected)
        assert_same_semantic_ids(got_batched.semantic_ids, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama"])
@pytest.mark.parametrize("beam_width", [8, 40])
def test_decoder_prompt_embeds_equal_hf(model_dirs, device, arch, beam_width):
    catalog = random_catalog(600, LEVELS, CODEBOOK, seed=1)
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    engine = Engine.from_pretrained(
        model_dirs[arch], catalog=catalog, sid_token_ids=sid_map, device=device
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.float32).eval()
    prompts, hf_inputs = prompts_for(hf.get_input_embeddings(), beam_width, vocab_base=96)

    def oracle(hf_input):
        if isinstance(hf_input, torch.Tensor):
            return hf_constrained_beam_search_embeds(hf, hf_input, catalog, sid_map, beam_width)
        return hf_constrained_beam_search(hf, hf_input, catalog, sid_map, beam_width)

    check_against_hf(engine, prompts, hf_inputs, oracle, beam_width)


@pytest.mark.parametrize("device", DEVICES)
def test_t5_prompt_embeds_are_the_encoders_input(tmp_path, device):
    vocab = OFFSET + LEVELS * CODEBOOK
    write_random_t5(tmp_path, "gated-gelu", False, vocab_size=vocab, seed=3)
    catalog = random_catalog(600, LEVELS, CODEBOOK, seed=2)
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    engine = Engine.from_pretrained(tmp_path, catalog=catalog, sid_token_ids=sid_map, device=device)
    hf = T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts, hf_inputs = prompts_for(hf.get_input_embeddings(), 5, vocab_base=vocab)
    for beam_width in (8, 40):

        def oracle(hf_input, beam_width=beam_width):
            return hf_t5_constrained_beam_search(hf, hf_input, catalog, sid_map, beam_width)

        check_against_hf(engine, prompts, hf_inputs, oracle, beam_width)


@pytest.fixture(scope="module")
def small_engine(model_dirs):
    catalog = random_catalog(200, LEVELS, CODEBOOK, seed=4)
    return Engine.from_pretrained(
        model_dirs["qwen3"], catalog=catalog, sid_token_ids=sequential_sid_map(3, 16, 8)
    )


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (Prompt([1, 2, 3], [(0, np.zeros((2, 5), np.float32))]), r"span 0 \(offset 0\).*\(n, 64\)"),
        (Prompt([1, 2, 3], [(2, np.zeros((2, 64), np.float32))]), "rows 2..3 are outside"),
        (Prompt([1, 2, 3], [(-1, np.zeros((1, 64), np.float32))]), "outside the prompt"),
        (
            Prompt(
                [1, 2, 3, 4],
                [(0, np.zeros((2, 64), np.float32)), (1, np.zeros((1, 64), np.float32))],
            ),
            "spans 0 and 1 overlap",
        ),
        (Prompt([1, 2], [(0, np.full((1, 64), np.nan, np.float32))]), "NaN or infinite"),
        (
            Prompt([1, 2], [(1, torch.full((1, 64), float("inf")))]),
            r"span 0 \(offset 1\): values hold",
        ),
        (Prompt([1, 2], [(0, np.zeros((1, 64), np.float64))]), "float32 or float16 NumPy arrays"),
        (Prompt([1, 2], [(0, torch.zeros(1, 64, dtype=torch.int64))]), "float32, bfloat16"),
        (Prompt([1, 2], [(True, np.zeros((1, 64), np.float32))]), "offset must be an int"),
        (Prompt([1, 2], [(0, [[0.0] * 64])]), "NumPy array or a torch tensor"),
        (Prompt([1, 2], [(0,)]), r"span 0 must be an \(offset, values\) pair"),
        (Prompt([1, 2], np.zeros((2, 64), np.float32)), "list of \\(offset, values\\) spans"),
        (Prompt(embeds=[(0, np.zeros((1, 64), np.float32))]), "one \\(n, hidden_size\\) array"),
        (Prompt(embeds=np.zeros((0, 64), np.float32)), "n >= 1"),
        (
            Prompt(
                [1, 2],
                [(0, np.zeros((1, 64), np.float32))],
            ),
            None,
        ),
        (Prompt([1, 999], [(0, np.zeros((1, 64), np.float32))]), "token ids must be in"),
        (Prompt([1, 2], [(0, torch.zeros(1, 64, device="meta"))]), "dense tensor with data"),
        (Prompt([1, 2], [(0, torch.zeros(1, 64).to_sparse())]), "dense tensor with data"),
        (
            Prompt([1, 2], [(0, np.ma.masked_array(np.zeros((1, 64), np.float32)))]),
            "not a masked one",
        ),
        (Prompt([1, 2], [(0, np.zeros((1, 64), ">f4"))]), "machine's byte order"),
        (Prompt(Prompt([1, 2], []), []), "not another Prompt"),
    ],
)
def test_bad_spans_are_refused_by_name(small_engine, prompt, message):
    assert small_engine.runner.hidden_size == 64
    if message is None:  # the well-formed one passes
        assert small_engine.recommend([prompt], 4, 4, 2)[0].semantic_ids
        return
    with pytest.raises(XgrError, match=message):
        small_engine.recommend([prompt], 4, 4, 2)
    with pytest.raises(XgrError, match=f"prompt 1: .*{message}"):  # which of several
        small_engine.recommend([[1, 2], prompt], 4, 4, 2)


def test_float16_overflow_is_refused(model_dirs):
    catalog = random_catalog(200, LEVELS, CODEBOOK, seed=4)
    engine = Engine.from_pretrained(
        model_dirs["qwen3"], catalog=catalog, sid_token_ids=sequential_sid_map(3, 16, 8),
        dtype="float16",
    )  # fmt: skip
    with pytest.raises(XgrError, match="overflow the model's dtype"):
        engine.recommend([Prompt([1, 2], [(0, np.full((1, 64), 1e6, np.float32))])], 4, 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_largest_magnitude_equals_torch(dtype):
    gen = torch.Generator().manual_seed(0)
    values = (torch.randn(37, 64, generator=gen) * 100).to(dtype)
    assert largest_magnitude(values) == float(values.abs().amax())
    for special in (-float("inf"), float("inf")):
        with_special = values.clone()
        with_special[5, 7] = special
        assert largest_magnitude(with_special) == float("inf")
    with_nan = values.clone()
    with_nan[36, 63] = float("nan")
    with_nan[0, 0] = float("inf")
    assert np.isnan(largest_magnitude(with_nan))
    assert largest_magnitude(torch.zeros(1, 3, dtype=dtype)) == 0.0
    assert largest_magnitude(-torch.ones(1, 3, dtype=dtype) * 2) == 2.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_spans_replay_one_prefill_graph_per_shape(model_dirs):
    """bf16 on CUDA: prompts with spans replay their own prefill graph, whatever the spans,
    and give the results of the eager path."""
    catalog = random_catalog(600, LEVELS, CODEBOOK, seed=6)
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    engines = [
        Engine.from_pretrained(
            model_dirs["qwen3"],
            catalog=catalog,
            sid_token_ids=sid_map,
            device="cuda",
            dtype="bfloat16",
            cuda_graphs=graphs,
        )  # fmt: skip
        for graphs in (True, False)
    ]
    graphed, eager = engines
    embedding = graphed.model.model.embed_tokens
    for seed in (0, 1):
        prompts, _ = prompts_for(embedding, seed, vocab_base=96)
        for batch in (prompts, prompts[:1], prompts[1:2]):
            got = graphed.recommend(batch, 16, 16, 8)
            want = eager.recommend(batch, 16, 16, 8)
            for g, w in zip(got, want, strict=True):
                assert [c for c, _ in g.semantic_ids] == [c for c, _ in w.semantic_ids]
        if seed == 0:
            captures = graphed.graphs.captures
    assert graphed.graphs.captures == captures  # new spans, the same graphs
