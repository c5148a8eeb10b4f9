"""The quick demo pipeline end to end on real MovieLens-100K (downloaded from PyPI)."""

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.demo.conftest import demo_cache
from tests.hf_oracle import assert_same_semantic_ids, hf_constrained_beam_search
from xgr import Engine, ItemCatalog
from xgr.catalog import CATALOG_METADATA_FILE, resolve_history
from xgr.core import XgrError
from xgr.demo import (
    DemoConfig,
    build_demo,
    evaluate_demo,
    leave_one_out,
    load_demo_catalog,
    load_movielens,
    read_demo_metadata,
)


@pytest.fixture(scope="module")
def cache_dir(movielens_cache, tmp_path_factory):
    return demo_cache(movielens_cache, tmp_path_factory, "demo-cache")


@pytest.fixture(scope="module")
def model_dir(cache_dir):
    config = DemoConfig.quick()
    # A leftover folder from an interrupted build must be replaced, not reused.
    stale = cache_dir / f"model-{config.cache_key}"
    stale.mkdir()
    (stale / "config.json").write_text("{}")
    return build_demo(cache_dir, config, progress=False)


def test_movielens_data(cache_dir):
    data = load_movielens(cache_dir)
    assert len(data.sequences) == 943 and len(data.item_ids) == 1682
    assert sum(map(len, data.sequences.values())) == 100_000
    assert data.titles["127"] == "Godfather, The (1972)"
    assert data.titles["50"] == "Star Wars (1977)"
    assert (cache_dir / "ml-100k" / "ml-100k.inter").is_file()


def test_model_folder_loads_with_transformers(model_dir):
    files = {p.name for p in model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "items.json"} <= files
    assert {"catalog.index.json", CATALOG_METADATA_FILE, "xgr_demo.json"} <= files
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    config = model.config
    assert config.model_type == "qwen2" and config.tie_word_embeddings
    assert config.num_key_value_heads < config.num_attention_heads
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert config.vocab_size == 4 + 3 * 8
    quick = DemoConfig.quick()
    assert config.max_position_embeddings >= 1 + (quick.max_history + 1) * 3 + 8
    logits = model(torch.tensor([[1, 4, 12, 20]])).logits
    assert logits.shape == (1, 4, 28) and torch.isfinite(logits).all()


def test_tokenizer_and_prompt(model_dir, cache_dir):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    meta = read_demo_metadata(model_dir)
    sid_ids = np.array(meta["sid_token_ids"])
    assert sid_ids.shape == (3, 8)
    assert tokenizer.convert_tokens_to_ids(["<a_0>", "<b_0>", "<c_7>"]) == [4, 12, 27]
    assert tokenizer.convert_tokens_to_ids("<a_0>") == sid_ids[0, 0]
    spaced = tokenizer("<bos> <a_1> <b_2> <c_3>", add_special_tokens=False)["input_ids"]
    packed = tokenizer("<bos><a_1><b_2><c_3>", add_special_tokens=False)["input_ids"]
    assert spaced == packed == [1, 5, 14, 23]

    engine = Engine.from_pretrained(model_dir)
    history = leave_one_out(load_movielens(cache_dir)).histories[0]
    ids = engine.history_prompt(history)
    recent = history[-meta["max_history"] :]
    text = "<bos> " + " ".join(
        engine.catalog.format_semantic_id(engine.catalog.codes_of(i)) for i in recent
    )
    assert len(ids) == 1 + 3 * meta["max_history"] and ids[0] == 1
    assert tokenizer(text, add_special_tokens=False)["input_ids"] == ids
    last = engine.catalog.codes_of(history[-1])
    assert ids[-3:] == [int(sid_ids[level, code]) for level, code in enumerate(last)]


def test_catalog_and_titles_saved(model_dir):
    catalog = load_demo_catalog(model_dir)
    assert len(catalog) == 1682 and catalog.num_levels == 3 and catalog.codebook_size == 8
    meta = json.loads((model_dir / CATALOG_METADATA_FILE).read_text())
    assert meta["fingerprint"] == catalog.fingerprint
    reread = ItemCatalog.from_index_json(model_dir / "catalog.index.json")
    assert reread.fingerprint == catalog.fingerprint
    titles = json.loads((model_dir / "items.json").read_text())
    assert resolve_history(catalog, ["Star Wars (1977)", "127"], titles).item_ids == ["50", "127"]


def test_cache_is_reused_and_keyed_by_config(model_dir, cache_dir):
    assert build_demo(cache_dir, DemoConfig.quick(), progress=False) == model_dir
    changed = DemoConfig.quick().with_changes(seed=1)
    assert changed.cache_key != DemoConfig.quick().cache_key
    assert not list(cache_dir.glob(".building-*"))


def test_engine_equals_hf_generate_on_demo_users(model_dir, cache_dir):
    engine = Engine.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    sid_map = np.array(read_demo_metadata(model_dir)["sid_token_ids"])
    histories = leave_one_out(load_movielens(cache_dir)).histories[:3]
    prompts = [engine.history_prompt(h) for h in histories]
    results = engine.recommend(prompts, beam_width=16, top_k=16, num_results=16)
    for prompt, result in zip(prompts, results, strict=True):
        expected = hf_constrained_beam_search(hf, prompt, engine.catalog, sid_map, 16)
        assert_same_semantic_ids(result.semantic_ids, expected)


def test_evaluate_demo_report(model_dir, cache_dir):
    engine = Engine.from_pretrained(model_dir)
    report = evaluate_demo(
        engine, load_movielens(cache_dir), k=10, beam_width=16, max_users=30, progress=False
    )
    assert report["users"] == 30 and report["short_lists"] == 0
    for scores in (report["model"], report["popularity"]):
        assert 0.0 <= scores["ndcg@10"] <= scores["recall@10"] <= 1.0
    with pytest.raises(XgrError, match="beam_width"):
        evaluate_demo(engine, load_movielens(cache_dir), k=10, beam_width=8, progress=False)
