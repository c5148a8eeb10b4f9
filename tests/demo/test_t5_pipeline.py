"""The quick TIGER-style T5 demo end to end on real MovieLens-100K: build, serve, evaluate."""

import json
import math

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from tests.demo.conftest import demo_cache
from tests.hf_oracle import assert_same_semantic_ids, hf_t5_constrained_beam_search
from xgr import Engine
from xgr.cli import main
from xgr.demo import (
    DemoConfig,
    build_demo,
    evaluate_demo,
    leave_one_out,
    load_movielens,
    read_demo_metadata,
)
from xgr.engine.prompt import PROMPT_FORMAT_FILE
from xgr.training.examples import seq2seq_examples
from xgr.training.models import scratch_vocab


@pytest.fixture(scope="module")
def cache_dir(movielens_cache, tmp_path_factory):
    return demo_cache(movielens_cache, tmp_path_factory, "demo-t5-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir):
    return build_demo(cache_dir, DemoConfig.quick("t5"), progress=False)


def test_folder_is_a_t5_with_the_demo_files(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "t5" and config["vocab_size"] == 4 + 3 * 8
    assert config["decoder_start_token_id"] == 0 and config["n_positions"] == 1 + 8 * 3
    assert config["num_layers"] == config["num_decoder_layers"] == 1
    files = {p.name for p in model_dir.iterdir()}
    assert {"model.safetensors", "tokenizer.json", "catalog.index.json", "items.json"} <= files
    prompt = json.loads((model_dir / PROMPT_FORMAT_FILE).read_text())
    assert prompt == {"prefix_tokens": ["<bos>"], "max_history_items": 8}
    meta = read_demo_metadata(model_dir)
    assert meta["config"]["arch"] == "t5" and meta["cache_key"] != DemoConfig.quick().cache_key
    assert np.array(meta["sid_token_ids"]).tolist() == (4 + np.arange(24).reshape(3, 8)).tolist()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer("<bos><a_1><b_2><c_3>", add_special_tokens=False)["input_ids"] == [
        1,
        5,
        14,
        23,
    ]


def test_training_lowered_the_loss(model_dir):
    training = read_demo_metadata(model_dir)["training"]
    assert training["steps"] == 20
    # Uniform over the 28 tokens is ln 28 = 3.33 nats; a model that learned which tokens
    # each level uses is below it, and below where it started.
    assert training["final_loss"] < training["first_loss"]
    assert training["final_loss"] < math.log(28)


def test_examples_pair_each_history_with_the_next_item(model_dir, cache_dir):
    engine = Engine.from_pretrained(model_dir)
    sequence = leave_one_out(load_movielens(cache_dir)).histories[0][:12]
    vocab = scratch_vocab(engine.catalog)
    examples = seq2seq_examples([sequence], engine.catalog, 8, vocab.code_tokens, vocab.prefix)
    assert len(examples) == 11
    last = examples[10]  # target item 11, after the 8 most recent items 3..10
    assert last.input_ids.tolist() == engine.history_prompt(sequence[3:11])
    sid_map = np.array(read_demo_metadata(model_dir)["sid_token_ids"])
    codes = engine.catalog.codes_of(sequence[11])
    assert last.labels.tolist() == [int(sid_map[lvl, c]) for lvl, c in enumerate(codes)]
    assert examples[0].input_ids.tolist() == engine.history_prompt(sequence[:1])


def test_engine_serves_it_and_equals_hf_generate(model_dir, cache_dir):
    engine = Engine.from_pretrained(model_dir)
    assert engine.model.is_encoder_decoder
    hf = AutoModelForSeq2SeqLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sid_map = np.array(read_demo_metadata(model_dir)["sid_token_ids"])
    histories = leave_one_out(load_movielens(cache_dir)).histories[:2]
    prompts = [engine.history_prompt(h) for h in histories]
    results = engine.recommend(
        prompts,
        beam_width=16,
        top_k=16,
        num_results=10,
        exclude_item_ids=[set(h) for h in histories],
    )
    for history, prompt, result in zip(histories, prompts, results, strict=True):
        assert result.items and not {r.item_id for r in result.items} & set(history)
        assert all(engine.catalog.codes_of(r.item_id) == r.semantic_id for r in result.items)
        expected = hf_t5_constrained_beam_search(hf, prompt, engine.catalog, sid_map, 16)
        got = engine.recommend([prompt], beam_width=16, top_k=16, num_results=16)[0]
        assert_same_semantic_ids(got.semantic_ids, expected)


def test_evaluate_t5_demo(model_dir, cache_dir):
    report = evaluate_demo(
        Engine.from_pretrained(model_dir),
        load_movielens(cache_dir),
        k=10,
        beam_width=16,
        max_users=30,
        progress=False,
    )
    assert report["users"] == 30 and report["short_lists"] == 0
    for scores in (report["model"], report["popularity"]):
        assert 0.0 <= scores["ndcg@10"] <= scores["recall@10"] <= 1.0


def test_cli_eval_compares_architectures(model_dir, cache_dir, tmp_path, monkeypatch):
    # The CLI builds each arch's default demo; the quick ones stand in for them here.
    monkeypatch.setattr(DemoConfig, "for_arch", classmethod(lambda cls, arch: cls.quick(arch)))
    output = tmp_path / "eval.json"
    args = ["eval", "--demo", "--cache-dir", str(cache_dir), "--arch", "qwen2", "--arch", "t5"]
    args += ["--max-users", "20", "--beam-width", "16", "--output", str(output)]
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    rows = {line.split("  ")[0].strip(): line.split()[-2:] for line in result.output.splitlines()}
    report = json.loads(output.read_text())
    assert set(report) == {"qwen2", "t5"}
    for arch in ("qwen2", "t5"):
        scores = report[arch]["model"]
        assert rows[f"model ({arch})"] == [f"{scores['recall@10']:.4f}", f"{scores['ndcg@10']:.4f}"]
    assert report["qwen2"]["popularity"] == report["t5"]["popularity"]
    assert rows["popularity"][0] == f"{report['t5']['popularity']['recall@10']:.4f}"
    # The t5 folder is the fixture's, reused: the cache is keyed per arch.
    assert len(list(cache_dir.glob("model-*"))) == 2
