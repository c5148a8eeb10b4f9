"""Engine behaviour: valid results, collisions, small catalogs, batch invariance, errors."""

from __future__ import annotations

import array
import json

import numpy as np
import pytest
import torch

from tests.conftest import (
    random_catalog,
    sequential_sid_map,
    write_code_tokenizer,
    write_random_model,
)
from xgr import Engine, ItemCatalog, XgrError
from xgr.core import ModelOutputError, RecommendResult

OFFSET = 8


def make_engine(model_dirs, catalog, arch="qwen2", **kwargs):
    sid_map = sequential_sid_map(catalog.num_levels, catalog.codebook_size, OFFSET)
    return Engine.from_pretrained(
        model_dirs[arch], catalog=catalog, sid_token_ids=sid_map, **kwargs
    )


def random_prompts(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (n,), generator=gen).tolist() for n in lengths]


def test_results_are_valid_and_unique(model_dirs):
    catalog = random_catalog(500, 3, 16, seed=3)
    engine = make_engine(model_dirs, catalog)
    for result in engine.recommend(random_prompts([4, 30]), beam_width=32, top_k=8, num_results=32):
        ids = [r.item_id for r in result.items]
        assert len(ids) == len(set(ids)) >= 32
        scores = [r.score for r in result.items]
        assert scores == sorted(scores, reverse=True)
        for rec in result.items:
            assert catalog.codes_of(rec.item_id) == rec.semantic_id
            assert np.isfinite(rec.score) and rec.score < 0


def test_collisions_are_returned_together_in_catalog_order(model_dirs):
    codes = [[0, 0], [1, 1], [0, 0], [2, 3], [0, 0]]
    catalog = ItemCatalog.from_codes(["x", "y", "z", "w", "v"], codes, 4)
    engine = make_engine(model_dirs, catalog)
    (result,) = engine.recommend(random_prompts([6]), beam_width=4, top_k=4, num_results=3)
    assert len(result.semantic_ids) == 3
    ids = [r.item_id for r in result.items]
    assert sorted(ids) == ["v", "w", "x", "y", "z"]
    start = ids.index("x")
    assert ids[start : start + 3] == ["x", "z", "v"]
    assert len({r.score for r in result.items[start : start + 3]}) == 1


def test_catalog_smaller_than_beam_width(model_dirs):
    catalog = random_catalog(5, 3, 16, seed=4)
    engine = make_engine(model_dirs, catalog)
    (result,) = engine.recommend(random_prompts([9]), beam_width=64, top_k=64, num_results=64)
    assert sorted(r.item_id for r in result.items) == sorted(catalog.item_ids)
    assert len(result.semantic_ids) == catalog.num_semantic_ids


def test_one_item_catalog_with_beam_8(model_dirs):
    catalog = ItemCatalog.from_codes(["only"], [[3, 7, 1]], 16)
    engine = make_engine(model_dirs, catalog)
    (result,) = engine.recommend(random_prompts([5]), beam_width=8, top_k=8, num_results=8)
    assert [(r.item_id, r.semantic_id) for r in result.items] == [("only", (3, 7, 1))]


def test_prefix_with_one_continuation(model_dirs):
    # Every path starting with code 5 continues only with (2, 9); other prefixes branch.
    codes = [[5, 2, 9]] + [[a, b, c] for a in (0, 1) for b in range(4) for c in range(4)]
    catalog = ItemCatalog.from_codes([f"i{i}" for i in range(len(codes))], codes, 16)
    engine = make_engine(model_dirs, catalog)
    (result,) = engine.recommend(random_prompts([7]), beam_width=48, top_k=48, num_results=33)
    assert len(result.items) == 33
    assert ("i0", (5, 2, 9)) in [(r.item_id, r.semantic_id) for r in result.items]


def test_batch_invariance(model_dirs):
    catalog = random_catalog(400, 3, 16, seed=5)
    engine = make_engine(model_dirs, catalog, arch="qwen3")
    prompts = random_prompts([3, 50, 17, 1], seed=2)
    together = engine.recommend(prompts, beam_width=16, top_k=16, num_results=10)
    for prompt, batched in zip(prompts, together, strict=True):
        (alone,) = engine.recommend([prompt], beam_width=16, top_k=16, num_results=10)
        assert [r.item_id for r in alone.items] == [r.item_id for r in batched.items]
        np.testing.assert_allclose(
            [r.score for r in alone.items], [r.score for r in batched.items], atol=1e-5
        )


def test_top_k_below_beam_width_limits_children(model_dirs):
    catalog = random_catalog(800, 2, 16, seed=6)
    engine = make_engine(model_dirs, catalog)
    (result,) = engine.recommend(random_prompts([8]), beam_width=16, top_k=2, num_results=16)
    first_codes = [codes[0] for codes, _ in result.semantic_ids]
    assert max(first_codes.count(c) for c in set(first_codes)) <= 2
    # The root alone starts all beams: top_k=1 still gives beam_width results.
    (result,) = engine.recommend(random_prompts([8]), beam_width=16, top_k=1, num_results=16)
    assert len(result.semantic_ids) == 16
    assert len({codes[0] for codes, _ in result.semantic_ids}) == 16


def test_exclude_item_ids_skips_and_refills(model_dirs):
    catalog = random_catalog(300, 3, 16, seed=7)
    engine = make_engine(model_dirs, catalog)
    prompt = random_prompts([10])
    (full,) = engine.recommend(prompt, beam_width=32, top_k=32, num_results=5)
    banned = {full.items[0].item_id, full.items[2].item_id}
    (result,) = engine.recommend(
        prompt, beam_width=32, top_k=32, num_results=5, exclude_item_ids=[banned]
    )
    ids = [r.item_id for r in result.items]
    assert not banned & set(ids)
    assert len(ids) >= 5
    assert ids[:2] == [full.items[1].item_id, full.items[3].item_id]
    assert full.complete and result.complete


def test_exclusions_of_the_best_beams_refill_inside_the_search(model_dirs):
    catalog = random_catalog(300, 3, 16, seed=7)
    engine = make_engine(model_dirs, catalog)
    prompt = random_prompts([10])
    (wide,) = engine.recommend(prompt, beam_width=8, top_k=8, num_results=8)
    assert wide.complete and len(wide.semantic_ids) == 8
    # Every item of the 8 final beams but those of the best one is excluded.
    items = {
        sid: [r.item_id for r in wide.items if r.semantic_id == sid] for sid, _ in wide.semantic_ids
    }
    best = wide.semantic_ids[0][0]
    banned = {i for sid, ids in items.items() if sid != best for i in ids}
    (short,) = engine.recommend(
        prompt, beam_width=8, top_k=8, num_results=3, exclude_item_ids=[banned]
    )
    # The search never spends a beam on them: three semantic IDs come back all the same
    # (with the beams they freed, the search may find better ones than the first run's).
    assert short.complete and len(short.semantic_ids) == 3
    assert not {codes for codes, _ in short.semantic_ids} & (set(items) - {best})
    assert not banned & {r.item_id for r in short.items}


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_agrees_with_float32(model_dirs, dtype):
    catalog = random_catalog(400, 3, 16, seed=8)
    prompts = random_prompts([12, 40], seed=3)
    ref = make_engine(model_dirs, catalog).recommend(prompts, beam_width=16, num_results=10)
    low = make_engine(model_dirs, catalog, dtype=dtype).recommend(
        prompts, beam_width=16, num_results=10
    )
    assert low[0].items[0].semantic_id[0] in {c[0] for c, _ in ref[0].semantic_ids}
    for a, b in zip(ref, low, strict=True):
        overlap = {c for c, _ in a.semantic_ids} & {c for c, _ in b.semantic_ids}
        assert len(overlap) >= 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(beam_width=4, num_results=5), "num_results"),
        (dict(beam_width=0), "beam_width"),
        (dict(top_k=0), "top_k"),
        (dict(num_results=0), "num_results"),
        (dict(beam_width=4097), "at most 4096"),
    ],
)
def test_bad_search_params(model_dirs, kwargs, message):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    with pytest.raises(XgrError, match=message):
        engine.recommend(random_prompts([4]), **kwargs)


def test_bad_prompts(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    with pytest.raises(XgrError, match="empty prompt"):
        engine.recommend([[]])
    with pytest.raises(XgrError, match="exceeds the model's limit of 254"):
        engine.recommend([[1] * 255])
    engine.recommend([[1] * 254], beam_width=2, num_results=1)  # the longest that fits
    with pytest.raises(XgrError, match="token ids"):
        engine.recommend([[1, 96]])
    with pytest.raises(XgrError, match="tokenizer"):
        engine.recommend(["<a_1>"])
    assert engine.recommend([]) == []


def test_code_map_must_match_catalog(model_dirs):
    catalog = random_catalog(50, 3, 16, seed=9)
    with pytest.raises(XgrError, match="3 levels"):
        Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=np.zeros((2, 16)))
    with pytest.raises(XgrError, match="codes per level"):
        Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=np.zeros((3, 8)))
    with pytest.raises(XgrError, match="outside the vocabulary"):
        Engine.from_pretrained(
            model_dirs["qwen2"], catalog, sid_token_ids=sequential_sid_map(3, 16, 90)
        )
    # Errors of the engine's construction are the folder's too, as XgrError.
    with pytest.raises(XgrError, match="cannot load model folder.*ValueError"):
        Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=[[1, 2], [3]])
    with pytest.raises(XgrError, match="cannot load model folder.*bogus_option"):
        make_engine(model_dirs, catalog, bogus_option=1)


def test_a_catalog_is_checked_against_the_one_the_model_was_trained_with(tmp_path):
    catalog = random_catalog(50, 3, 16, seed=10)
    write_random_model(tmp_path, "qwen2")
    sid_map = sequential_sid_map(3, 16, OFFSET)
    catalog.write_model_metadata(tmp_path, sid_token_ids=sid_map)
    Engine.from_pretrained(tmp_path, catalog, sid_token_ids=sid_map)
    # New and removed items are fine; an item with other codes is named.
    codes = catalog.codes.tolist()
    grown = ItemCatalog.from_codes([*catalog.item_ids[5:], "new"], [*codes[5:], [1, 2, 3]], 16)
    assert len(Engine.from_pretrained(tmp_path, grown, sid_token_ids=sid_map).catalog) == 46
    requantized = random_catalog(50, 3, 16, seed=11)
    with pytest.raises(XgrError, match="other semantic IDs than the model in .* was trained"):
        Engine.from_pretrained(tmp_path, requantized, sid_token_ids=sid_map)
    with pytest.raises(XgrError, match="code-to-token map differs"):
        Engine.from_pretrained(tmp_path, catalog, sid_token_ids=sequential_sid_map(3, 16, 9))
    # A record written before the items were kept: the same catalog only.
    path = tmp_path / "xgr_catalog.json"
    path.write_text(json.dumps({"fingerprint": catalog.fingerprint}))
    Engine.from_pretrained(tmp_path, catalog, sid_token_ids=sid_map)
    with pytest.raises(XgrError, match="fingerprint"):
        Engine.from_pretrained(tmp_path, grown, sid_token_ids=sid_map)


def test_catalog_and_code_map_found_in_the_folder(tmp_path):
    """Default catalog file and code tokens named like the catalog's codes in tokenizer.json."""
    catalog = random_catalog(60, 3, 16, seed=12)
    write_code_tokenizer(tmp_path, 3, 16, OFFSET)
    write_random_model(tmp_path, "qwen2")
    catalog.to_index_json(tmp_path / "catalog.index.json")
    engine = Engine.from_pretrained(tmp_path)
    assert engine.catalog.fingerprint == catalog.fingerprint
    np.testing.assert_array_equal(engine.sid_token_ids.numpy(), sequential_sid_map(3, 16, OFFSET))
    by_text = engine.recommend(["<t1> <a_3> <b_4> <c_5>"], beam_width=8, num_results=5)
    by_ids = engine.recommend(
        [[1, OFFSET + 3, OFFSET + 20, OFFSET + 37]], beam_width=8, num_results=5
    )
    assert by_text[0].items == by_ids[0].items


def test_missing_catalog_and_tokenizer_are_reported(tmp_path):
    write_random_model(tmp_path, "llama")
    with pytest.raises(XgrError, match="no catalog"):
        Engine.from_pretrained(tmp_path)
    with pytest.raises(XgrError, match="no tokenizer"):
        Engine.from_pretrained(tmp_path, random_catalog(10, 3, 16, seed=1))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(XgrError, match="unsupported model_type"):
        Engine.from_pretrained(tmp_path, random_catalog(10, 3, 16, seed=1), sid_token_ids=[[0]])


def test_non_finite_model_output_is_an_error_not_a_result(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=13))
    engine.model.lm_head.weight.data.fill_(float("nan"))
    with pytest.raises(ModelOutputError, match="no finite log-probability for prompts \\[0\\]"):
        engine.recommend(random_prompts([4]), beam_width=4, num_results=2)
    with pytest.raises(ModelOutputError, match="float32\\); check the weights for NaN"):
        engine.recommend(random_prompts([4]), beam_width=4, num_results=2)
    # Rules that leave items do not hide it; rules that leave none give an empty result.
    items = engine.catalog.item_ids
    with pytest.raises(ModelOutputError, match="no finite log-probability"):
        engine.recommend(random_prompts([4]), 4, 4, 2, exclude_item_ids=[items[:3]])
    with pytest.raises(ModelOutputError, match="no finite log-probability"):
        engine.recommend(random_prompts([4]), 4, 4, 2, allow_item_ids=[items[5:6]])
    (nothing,) = engine.recommend(random_prompts([4]), 4, 4, 2, allow_item_ids=[["absent"]])
    assert nothing.items == [] and not nothing.complete


@pytest.mark.parametrize(
    "prompt",
    [
        [1.5, 2], [True, 3], [5, 0, False], [np.True_, 9], ["7"], 5, None, [[1, 2], [3, 4]],
        [1, [2]], [None, 3], [2**70], np.array([1.0, 2.0]), np.array([[1, 2]]),
        np.array([True, False]), [np.array(True), 3], np.ma.array([1, 10**6], mask=[0, 1]),
        torch.tensor([1.0, 2.0]), torch.tensor([True]), memoryview(b"\x05"),
        [torch.tensor(5, device="meta"), 6], [torch.tensor(5, dtype=torch.bfloat16)],
        torch.tensor([5, 6]).to_sparse(), [np.uint64(2**63), -1],
    ],
    ids=[
        "float", "bool", "bool-zero", "numpy-bool", "str-id", "int", "none", "nested",
        "ragged", "none-item", "huge", "float-array", "2-d-array", "bool-array",
        "0-d-bool-item", "masked-array", "float-tensor", "bool-tensor", "memoryview",
        "meta-tensor-item", "bf16-tensor-item", "sparse-tensor", "beyond-int64",
    ],
)  # fmt: skip
def test_prompts_must_be_token_id_lists(model_dirs, prompt):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    with pytest.raises(XgrError, match="list of integer token ids"):
        engine.recommend([prompt])
    with pytest.raises(XgrError, match="list of integer token ids"):
        engine.tokenize(prompt)


def test_tokenize_gives_a_new_list_of_python_ints(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    vocab = engine.model.config.vocab_size
    for prompt in (
        [0, 1, vocab - 1], (4, 1), np.array([3, 0], dtype=np.int32), [np.int16(7), 2],
        np.array([5, 6], dtype=object), np.arange(10, dtype=np.uint8)[::3],
        torch.tensor([2, 9]), array.array("q", [4, 4]), [np.array(3), 8], range(3, 6),
        [np.uint64(5), np.int64(6)], [torch.tensor(5, dtype=torch.uint64), torch.tensor(6)],
    ):  # fmt: skip
        tokens = engine.tokenize(prompt)
        assert tokens == [int(t) for t in prompt]
        assert all(type(t) is int for t in tokens)
        assert tokens is not prompt
    for bad in ([vocab], [-1, 2], np.array([vocab], dtype=np.uint64)):
        with pytest.raises(XgrError, match=f"must be in \\[0, {vocab}\\)"):
            engine.tokenize(bad)
    with pytest.raises(XgrError, match="empty prompt"):
        engine.tokenize([])
    with pytest.raises(XgrError, match="empty prompt"):
        engine.tokenize(np.array([], dtype=np.float32))


def test_token_ids_give_a_new_int64_array_that_recommends_as_the_list(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    source = np.array([3, 0, 7], dtype=np.int32)
    for prompt in ([3, 0, 7], source, torch.tensor([3, 0, 7])):
        ids = engine.token_ids(prompt)
        assert ids.dtype == np.int64 and ids.shape == (3,)
        assert ids.tolist() == engine.tokenize(prompt) == [3, 0, 7]
    ids = engine.token_ids(source)
    source[0] = 9  # the array is the engine's own copy
    assert ids.tolist() == [3, 0, 7]
    search = dict(beam_width=8, top_k=8, num_results=8)
    (from_array,) = engine.recommend([ids], **search)
    (from_list,) = engine.recommend([[3, 0, 7]], **search)
    assert from_array.semantic_ids == from_list.semantic_ids
    with pytest.raises(XgrError, match="empty prompt"):
        engine.token_ids(np.array([], dtype=np.int64))


def test_numpy_values_are_accepted(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    (result,) = engine.recommend(
        [np.array([1, 2, 3])], beam_width=np.int64(4), top_k=np.int32(4), num_results=np.int64(2)
    )
    assert len(result.semantic_ids) == 2


def test_num_results_as_arrays_and_exclusions_as_a_generator(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    prompts = [[1, 2, 3], [4, 5]]
    results = engine.recommend(prompts, beam_width=8, num_results=np.array([3, 4]))
    assert [len(r.semantic_ids) for r in results] == [3, 4]
    results = engine.recommend(prompts, beam_width=8, num_results=np.array(2))
    assert [len(r.semantic_ids) for r in results] == [2, 2]
    with pytest.raises(XgrError, match="num_results needs one entry per prompt"):
        engine.recommend(prompts, beam_width=8, num_results=np.array([3]))
    with pytest.raises(XgrError, match="exclude_item_ids must be a list .* got generator"):
        engine.recommend(prompts, exclude_item_ids=(ids for ids in [["0"], ["1"]]))
    with pytest.raises(XgrError, match="exclude_item_ids must be a list .* got ndarray"):
        engine.recommend(prompts, exclude_item_ids=np.array("0"))  # 0-d: no entries


def corrupt(folder, name, text):
    (folder / name).write_text(text)


@pytest.mark.parametrize(
    ("name", "text", "fragment"),
    [
        ("model.safetensors", "garbage", "SafetensorError"),
        ("config.json", "[1, 2]", "cannot"),
        (
            "config.json",
            '{"model_type": "qwen2", "num_attention_heads": 0}',
            "config.json: num_attention_heads must be an integer >= 1, got 0",
        ),
        (
            "config.json",
            '{"model_type": "qwen2", "num_attention_heads": 2, "hidden_size": "64"}',
            "hidden_size must be an integer >= 1, got '64'",
        ),
        ("config.json", '{"model_type": "qwen2"}', "config.json lacks 'num_attention_heads'"),
        ("xgr_catalog.json", "{broken", "cannot read .*xgr_catalog.json"),
        ("tokenizer.json", "[]", "tokenizer.json"),
        ("xgr_prompt.json", "[]", "xgr_prompt.json must be a JSON object"),
        ("xgr_prompt.json", '{"prefix_tokens": "<a_0>"}', "must be a list of token strings"),
        ("xgr_prompt.json", '{"max_history_items": true}', "max_history_items must be"),
        ("items.json", '{"x": null}', "titles must be strings"),
    ],
)
def test_malformed_folders_raise_xgr_errors(tmp_path, name, text, fragment):
    write_random_model(tmp_path, "qwen2")
    write_code_tokenizer(tmp_path, 3, 16, OFFSET)
    random_catalog(20, 3, 16, seed=1).to_index_json(tmp_path / "catalog.index.json")
    corrupt(tmp_path, name, text)
    with pytest.raises(XgrError, match=fragment):
        Engine.from_pretrained(tmp_path)


def test_folder_json_files_may_start_with_a_byte_order_mark(tmp_path):
    write_random_model(tmp_path, "qwen2")
    write_code_tokenizer(tmp_path, 3, 16, OFFSET)
    catalog = random_catalog(20, 3, 16, seed=1)
    catalog.to_index_json(tmp_path / "catalog.index.json")
    catalog.write_model_metadata(tmp_path)
    (tmp_path / "items.json").write_text(
        json.dumps({catalog.item_ids[0]: "Café (1999)"}), encoding="utf-8"
    )
    for name in ("config.json", "items.json", "catalog.index.json", "xgr_catalog.json",
                 "tokenizer.json"):  # fmt: skip
        path = tmp_path / name
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    engine = Engine.from_pretrained(tmp_path)
    assert engine.titles == {catalog.item_ids[0]: "Café (1999)"}


def test_missing_folder_and_model_without_room_for_a_prompt(tmp_path):
    with pytest.raises(XgrError, match="does not exist"):
        Engine.from_pretrained(tmp_path / "nope")
    write_random_model(tmp_path, "qwen2", max_position_embeddings=2)
    with pytest.raises(XgrError, match="leaves no room"):
        Engine.from_pretrained(
            tmp_path,
            random_catalog(20, 3, 16, seed=1),
            sid_token_ids=sequential_sid_map(3, 16, OFFSET),
        )


def test_bad_devices(model_dirs):
    catalog = random_catalog(20, 3, 16, seed=1)
    for device, fragment in [("foo", "unknown device"), ("mps", "not supported")]:
        with pytest.raises(XgrError, match=fragment):
            make_engine(model_dirs, catalog, device=device)


@pytest.mark.parametrize(
    ("exclude", "message"),
    [(["item1"], "must be a list of item ids, got str"), ([{"a": 1}], "got dict")],
)
def test_exclude_item_ids_entries_must_be_lists(model_dirs, exclude, message):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=9))
    with pytest.raises(XgrError, match=message):
        engine.recommend(random_prompts([4]), exclude_item_ids=exclude)


def test_exclude_item_ids_as_a_numpy_array(model_dirs):
    catalog = random_catalog(300, 3, 16, seed=7)
    engine = make_engine(model_dirs, catalog)
    prompts = random_prompts([10, 5])
    first = [r.items[0].item_id for r in engine.recommend(prompts, beam_width=16, top_k=16)]
    again = engine.recommend(prompts, beam_width=16, top_k=16, exclude_item_ids=np.array([first]).T)
    assert [r.items[0].item_id for r in again] != first
    assert all(r.items[0].item_id not in first[i : i + 1] for i, r in enumerate(again))


def test_code_only_scores_are_log_softmax_over_each_level_codes(tmp_path):
    """full_vocab=False: each level normalized over its real code tokens only (-1 = unused)."""
    hf = write_random_model(tmp_path, "qwen2", seed=5)
    codes = np.random.default_rng(0).integers(0, 8, (40, 2))
    catalog = ItemCatalog.from_codes([f"i{i}" for i in range(40)], codes, 16)
    sid_map = sequential_sid_map(2, 16, OFFSET)
    sid_map[:, 8:] = -1  # codes 8..15 unused: no token
    engine = Engine.from_pretrained(
        tmp_path, catalog=catalog, sid_token_ids=sid_map, full_vocab=False
    )
    prompt = [5, 6, 7]
    (result,) = engine.recommend([prompt], beam_width=64, top_k=64, num_results=30)
    expected = {}
    with torch.no_grad():
        for row in catalog.semantic_ids.tolist():
            score, tokens = 0.0, list(prompt)
            for level, code in enumerate(row):
                logits = hf(torch.tensor([tokens])).logits[0, -1]
                score += torch.log_softmax(logits[sid_map[level, :8]], -1)[code].item()
                tokens.append(int(sid_map[level, code]))
            expected[tuple(row)] = score
    best = sorted(expected.items(), key=lambda kv: -kv[1])[: len(result.semantic_ids)]
    assert [c for c, _ in result.semantic_ids] == [c for c, _ in best]
    np.testing.assert_allclose([s for _, s in result.semantic_ids], [s for _, s in best], atol=1e-4)


def test_bfloat16_scores_are_never_positive(tmp_path):
    write_random_model(tmp_path, "qwen2", seed=0, initializer_range=1.0)
    catalog = random_catalog(200, 2, 16, seed=1)
    engine = Engine.from_pretrained(
        tmp_path, catalog=catalog, dtype="bfloat16", sid_token_ids=sequential_sid_map(2, 16, OFFSET)
    )
    results = engine.recommend(
        [[62, 87, 48, 58, 93, 70], *random_prompts([3, 9, 20], seed=4)],
        beam_width=8,
        top_k=8,
        num_results=8,
    )
    assert all(score <= 0 for r in results for _, score in r.semantic_ids)


def test_concurrent_calls_on_lanes_equal_calls_one_by_one(model_dirs):
    from concurrent.futures import ThreadPoolExecutor

    catalog = random_catalog(300, 3, 16, seed=12)
    engine = make_engine(model_dirs, catalog, cuda_streams=2)
    assert engine.max_in_flight == 1  # the CPU runs one batch whatever is asked
    batches = [random_prompts([5, 9], seed=s) for s in range(6)]
    alone = [engine.recommend(b, beam_width=8, top_k=8, num_results=8) for b in batches]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda b: engine.recommend(b, 8, 8, 8), batches))
    for a, b in zip(alone, together, strict=True):
        assert [[c for c, _ in r.semantic_ids] for r in a] == [
            [c for c, _ in r.semantic_ids] for r in b
        ]
    with pytest.raises(XgrError, match="cuda_streams"):
        make_engine(model_dirs, catalog, cuda_streams=0)
    with pytest.raises(XgrError, match="pipeline_depth"):
        make_engine(model_dirs, catalog, pipeline_depth=0)


def test_launched_batches_collect_to_the_recommend_results_in_any_order(model_dirs):
    engine = make_engine(model_dirs, random_catalog(300, 3, 16, seed=15))
    batches = [random_prompts([5, 9], seed=s) for s in range(3)] + [[]]
    alone = [engine.recommend(b, beam_width=8, top_k=8, num_results=8) for b in batches]
    # More launches than lanes, none collected yet: the CPU's work is done at launch.
    launched = [engine.recommend_async(b, 8, 8, 8) for b in batches]
    for want, pending in reversed(list(zip(alone, launched, strict=True))):
        got = pending.result()
        assert got is pending.result()  # collected once
        assert [r.semantic_ids for r in got] == [r.semantic_ids for r in want]
    with pytest.raises(XgrError, match="beam_width"):  # input errors come from the launch
        engine.recommend_async(batches[0], beam_width=0)


def test_a_launched_batch_keeps_its_model_error_for_every_collect(model_dirs):
    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=16))
    engine.model.lm_head.weight.data.fill_(float("nan"))
    pending = engine.recommend_async(random_prompts([4]), beam_width=4, num_results=2)
    for _ in range(2):
        with pytest.raises(ModelOutputError, match="no finite log-probability"):
            pending.result()
    assert engine._lanes._free.qsize() == engine.max_in_flight  # the lane came back


def test_warm_up_checks_arguments_and_captures_nothing_on_the_cpu(model_dirs):
    engine = make_engine(model_dirs, random_catalog(200, 3, 16, seed=21))
    assert engine.warm_up(30, 8, 8, 4) == 0
    for args, message in [
        ((0, 8, 8, 4), "prompt_tokens must be an integer >= 1"),
        ((30, 8, 8, 0), "max_batch_size must be an integer >= 1"),
        ((30, 8, 8, 4, 1.0), "spread"),
        ((30, 8, 8, 4, float("nan")), "spread"),
        ((float("inf"), 8, 8, 4), "prompt_tokens must be an integer"),
        (("10", 8, 8, 4), "prompt_tokens must be an integer"),
        ((10.7, 8, 8, 4), "prompt_tokens must be an integer"),
        ((30, 8, 8, 2.5), "max_batch_size must be an integer"),
        ((30, 8, 8, True), "max_batch_size must be an integer"),
        ((30, 0, 8, 4), "beam_width"),
    ]:
        with pytest.raises(XgrError, match=message):
            engine.warm_up(*args)
    # The spread may reach past the prompt limit (such prompts are refused anyway) ...
    assert engine.warm_up(engine.max_prompt_tokens, 8, 8, 1) == 0
    with pytest.raises(XgrError, match=f"{engine.max_prompt_tokens + 1} tokens exceed"):
        engine.warm_up(engine.max_prompt_tokens + 1, 8, 8, 1)  # ... the length itself not


def test_a_batch_whose_graphs_were_dropped_after_its_check_captures_alone(model_dirs, monkeypatch):
    """Two batches of one lane (pipeline depth 2): X finds its graph, then Y, capturing
    alone, grows the pool and drops every graph before X launches. X must then capture
    alone too (the check is repeated under the graphs' lock), never beside other launches.
    Graphs and launches are stand-ins recording the gate's state."""
    import queue
    import threading

    import xgr.engine.engine as engine_module
    import xgr.engine.results as results_module
    from xgr.engine.generate import PendingGeneration
    from xgr.engine.lanes import Lane

    engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=17))
    x_checked, y_dropped = threading.Event(), threading.Event()
    captures = []

    class StandInGraphs:
        def __init__(self):
            self.lock, self.shapes, self.x_checks = threading.RLock(), {1}, 0
            self.runner = engine.runner

        def use(self, spec, live):
            assert spec.runner is self.runner and list(live) == [spec]  # one catalog version

        def plan(self, lens, beam_width, top_k, together, filtered, embedded, runner):
            assert runner is self.runner
            return len(lens)

        def needs_capture(self, plan, lens, spec):
            assert spec.runner is self.runner
            missing = plan not in self.shapes
            if threading.current_thread().name == "X" and self.x_checks == 0:
                self.x_checks += 1
                x_checked.set()
                y_dropped.wait(5)  # Y's pool growth happens right after this check
            return missing

    def launch(spec, prompts, beam_width, top_k, graphs, plan, masks, spans=None):
        with graphs.lock:
            if threading.current_thread().name == "Y":
                graphs.shapes = set()  # the pool grew: every graph dropped
            if len(prompts) not in graphs.shapes:
                capturing = engine._lanes._gate._capturing
                captures.append((threading.current_thread().name, capturing))
                graphs.shapes.add(len(prompts))
            if threading.current_thread().name == "Y":
                y_dropped.set()
        empty = torch.zeros(len(prompts), beam_width, dtype=torch.int64)
        return PendingGeneration(empty, empty.float(), empty.float()[..., None])

    monkeypatch.setattr(engine_module, "launch_semantic_ids", launch)
    lanes = engine._lanes
    lanes.lanes = (Lane(0, None, StandInGraphs()), Lane(1, None, StandInGraphs()))
    lanes.depth, lanes._free = 2, queue.SimpleQueue()
    for lane in (0, 0, 1, 1):
        lanes._free.put(lanes.lanes[lane])
    monkeypatch.setattr(results_module, "build_result", lambda *args: RecommendResult())
    x = threading.Thread(name="X", target=lambda: engine.recommend_async([[5]], 4, 4, 1))
    y = threading.Thread(
        name="Y",
        target=lambda: (x_checked.wait(5), engine.recommend_async([[5, 6], [7, 8]], 4, 4, 1)),
    )
    for thread in (x, y):
        thread.start()
    for thread in (x, y):
        thread.join(10)
    assert not x.is_alive() and not y.is_alive()
    assert sorted(captures) == [("X", True), ("Y", True)]  # both captured alone


def test_catalog_with_other_levels_than_the_tokenizer_is_refused(tmp_path):
    write_random_model(tmp_path, "qwen2")
    write_code_tokenizer(tmp_path, 3, 16, OFFSET)  # <a_*>, <b_*>, <c_*>
    message = r"tokenizer has codes of levels a, b, c, but the catalog's levels are a, b:"
    with pytest.raises(XgrError, match=message):
        Engine.from_pretrained(tmp_path, random_catalog(20, 2, 16, seed=1))
    # The first level missing (the catalog's levels renamed b, c) is refused too.
    later = random_catalog(20, 2, 16, seed=1)
    later = ItemCatalog.from_codes(later.item_ids, later.codes, 16, level_names=("b", "c"))
    with pytest.raises(XgrError, match="catalog's levels are b, c"):
        Engine.from_pretrained(tmp_path, later)


def test_catalog_code_the_tokenizer_lacks_is_named(tmp_path):
    write_random_model(tmp_path, "qwen2")
    write_code_tokenizer(tmp_path, 3, 8, OFFSET)  # codes 0..7 only
    with pytest.raises(XgrError, match=r"the tokenizer has no <[abc]_\d+> token"):
        Engine.from_pretrained(tmp_path, random_catalog(50, 3, 16, seed=1))


def test_code_token_maps_must_be_integers_and_one_token_per_code(model_dirs):
    catalog = random_catalog(50, 3, 16, seed=1)
    table = sequential_sid_map(3, 16, OFFSET)
    with pytest.raises(XgrError, match="integer token ids, got dtype float64"):
        Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=table + 0.7)
    shared = table.copy()
    used = np.unique(catalog.codes[:, 1])
    shared[1, used[1]] = shared[1, used[0]]
    with pytest.raises(XgrError, match=f"codes {used[0]} and {used[1]} of level 1 both map"):
        Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=shared)
    # Levels may share tokens (one token per code, whatever the level).
    same = np.tile(table[0], (3, 1))
    Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=same)


def test_an_unused_code_on_a_used_code_token_does_not_hide_it(model_dirs):
    # Level 0 uses codes 1 and 2; unused code 0 maps to code 1's token.
    codes = np.array([[1, 0], [1, 1], [2, 0], [2, 1]])
    catalog = ItemCatalog.from_codes([f"i{i}" for i in range(4)], codes, 4)
    shared = sequential_sid_map(2, 4, OFFSET)
    shared[0, 0] = shared[0, 1]
    unused = shared.copy()
    unused[0, 0] = -1
    search = dict(beam_width=4, top_k=4, num_results=4)
    got, want = (
        Engine.from_pretrained(model_dirs["qwen2"], catalog, sid_token_ids=table).recommend(
            [[5, 6, 7]], **search
        )[0]
        for table in (shared, unused)
    )
    assert got.complete and len(got.semantic_ids) == 4
    assert got.semantic_ids == want.semantic_ids


def test_engine_switches_must_be_bools(model_dirs):
    catalog = random_catalog(50, 3, 16, seed=4)
    for option in ("full_vocab", "cuda_graphs", "first_levels_together"):
        for value in (None, 0, "no"):
            with pytest.raises(XgrError, match=f"{option} must be True or False"):
                make_engine(model_dirs, catalog, **{option: value})


def test_float_item_ids_in_exclusions_are_refused(model_dirs):
    engine = make_engine(model_dirs, random_catalog(100, 3, 16, seed=2))
    with pytest.raises(XgrError, match=r"exclude_item_ids\[0\] holds 181.0"):
        engine.recommend(random_prompts([4]), exclude_item_ids=[[181.0]])


def test_streams_on_the_cpu_are_ignored_with_a_warning(model_dirs, caplog):
    with caplog.at_level("WARNING", logger="xgr.engine.lanes"):
        engine = make_engine(model_dirs, random_catalog(50, 3, 16, seed=3), cuda_streams=4)
    assert engine.max_in_flight == 1
    assert "cuda_streams=4 ignored on the CPU" in caplog.text
