"""Catalog versions while serving: updates (items added, removed, attributes set, the whole
catalog replaced) and rollbacks; each version's results equal an engine built on that catalog,
a refused update changes nothing, and concurrent requests each see one version."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from tests.conftest import random_catalog, sequential_sid_map, write_random_model
from xgr import Engine, ItemCatalog, XgrError

LEVELS, CODEBOOK, OFFSET = 3, 16, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PROMPTS = [[9, 10, 11, 12], [20, 21, 22]]
SEARCH = dict(beam_width=16, top_k=16, num_results=8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("updates")
    write_random_model(path, "qwen3", seed=3)
    return path


def engine_on(folder, catalog, device="cpu"):
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    return Engine.from_pretrained(folder, catalog=catalog, sid_token_ids=sid_map, device=device)


def same_results(got, want):
    for g, w in zip(got, want, strict=True):
        assert [c for c, _ in g.semantic_ids] == [c for c, _ in w.semantic_ids]
        np.testing.assert_allclose(
            [s for _, s in g.semantic_ids], [s for _, s in w.semantic_ids], atol=1e-5
        )
        assert [r.item_id for r in g.items] == [r.item_id for r in w.items]


def tokens(codes):
    return [f"<{letter}_{c}>" for letter, c in zip("abc", codes, strict=True)]


@pytest.mark.parametrize("device", DEVICES)
def test_each_version_searches_as_an_engine_built_on_it(folder, device):
    catalog = random_catalog(300, LEVELS, CODEBOOK, seed=5)
    engine = engine_on(folder, catalog, device)
    first = engine.recommend(PROMPTS, **SEARCH)
    assert engine.catalog_version == 1 and all(r.catalog_version == 1 for r in first)
    # The top items go, new ones come (new semantic IDs and collisions with kept ones).
    removed = sorted({r.item_id for r in first[0].items[:4]})
    added = {"new0": tokens([15, 15, 15]), "new1": tokens([0, 1, 2]),
             "new2": catalog.codes[10].tolist()}  # fmt: skip
    assert engine.update_catalog(add=added, remove=removed) == 2
    kept = [i for i in catalog.item_ids if i not in removed]
    rows = [catalog.item_index[i] for i in kept]
    codes = np.concatenate([catalog.codes[rows], [[15, 15, 15], [0, 1, 2], catalog.codes[10]]])
    # Kept items keep their rows; the added ones take the removed ones' rows.
    served = engine.catalog
    assert dict(zip(served.item_ids, served.codes.tolist(), strict=True)) == dict(
        zip([*kept, *added], codes.tolist(), strict=True)
    )
    assert all(served.item_ids[catalog.item_index[i]] == i for i in kept[: -len(removed)])
    direct = engine_on(
        folder, ItemCatalog.from_codes(served.item_ids, served.codes, CODEBOOK), device
    )
    second = engine.recommend(PROMPTS, **SEARCH)
    assert all(r.catalog_version == 2 for r in second)
    same_results(second, direct.recommend(PROMPTS, **SEARCH))
    assert not {r.item_id for r in second[0].items} & set(removed)
    assert len(engine.catalog) == len(catalog) - len(removed) + 3
    # Back to the first version: its number and its results.
    assert engine.rollback_catalog() == 1
    again = engine.recommend(PROMPTS, **SEARCH)
    same_results(again, first)
    assert all(r.catalog_version == 1 for r in again)
    with pytest.raises(XgrError, match="no earlier catalog version"):
        engine.rollback_catalog()
    # A version number is never reused for other contents.
    replaced = ItemCatalog.from_index_dict(
        {i: tokens(catalog.codes[r]) for r, i in enumerate(catalog.item_ids[:100])}
    )
    assert engine.update_catalog(replace=replaced) == 3
    same_results(
        engine.recommend(PROMPTS, **SEARCH),
        engine_on(folder, replaced, device).recommend(PROMPTS, **SEARCH),
    )


def test_attributes_follow_the_items_and_can_be_set(folder, tmp_path):
    catalog = random_catalog(200, LEVELS, CODEBOOK, seed=6)
    lines = ["item_id,colour,price"] + [
        f"{item},{('red', 'blue')[row % 2]},{row}" for row, item in enumerate(catalog.item_ids)
    ]
    (tmp_path / "attributes.csv").write_text("\n".join(lines) + "\n")
    catalog.load_attributes(tmp_path / "attributes.csv")
    engine = engine_on(folder, catalog)
    red = [{"colour": "red"}]
    (before,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=red)
    assert before.items
    target = before.items[0].item_id
    engine.update_catalog(set_attributes={target: {"colour": "green", "price": None}},
                          add={"fresh": tokens([1, 1, 1])})  # fmt: skip
    (after,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=red)
    assert target not in {r.item_id for r in after.items}
    (green,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=[{"colour": "green"}])
    assert [r.item_id for r in green.items] == [target]
    (priced,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=[{"price": {"ge": 0}}])
    assert target not in {r.item_id for r in priced.items}
    assert "fresh" not in {r.item_id for r in priced.items}  # added without attributes
    # The earlier version keeps its own values.
    engine.rollback_catalog()
    (back,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=red)
    same_results([back], [before])


@pytest.mark.parametrize(
    ("update", "message"),
    [
        ({}, "needs items to add or remove"),
        ({"add": {"item1": tokens([1, 2, 3])}}, "cannot add items the catalog has"),
        ({"remove": ["nope", "item2"]}, "cannot remove items the catalog lacks: 'nope'"),
        ({"add": {"x": tokens([1, 2, 16])}}, "code out of range in item 'x'"),
        ({"add": {"x": [1, 2, 16]}}, r"outside the codebook \[0, 16\)"),
        ({"add": {"x": [1, 2]}}, "2 codes, the catalog has 3 levels"),
        ({"add": {"x": ["<a_1>", "<b_2>", "<d_3>"]}}, "levels"),
        ({"set_attributes": {"item1": {"colour": "red"}}}, "needs a catalog with attributes"),
        ({"remove": "item1"}, "remove must be a list"),
        ({"remove": ["item1", "item2", "item1"]}, "items listed twice in remove: 'item1'"),
        ({"add": {7: [1, 2, 3], "7": [1, 2, 4]}}, "add names an item twice"),
        ({"replace": {"item0": [1, 2, 3]}}, "replace takes an ItemCatalog"),
    ],
)
def test_a_refused_update_changes_nothing(folder, update, message):
    catalog = random_catalog(100, LEVELS, CODEBOOK, seed=7)
    engine = engine_on(folder, catalog)
    before = engine.recommend(PROMPTS, **SEARCH)
    with pytest.raises(XgrError, match=message):
        engine.update_catalog(**update)
    assert engine.catalog_version == 1 and engine.catalog is catalog
    same_results(engine.recommend(PROMPTS, **SEARCH), before)


def test_a_catalog_quantized_again_is_refused_with_the_moved_items(folder, tmp_path):
    catalog = random_catalog(100, LEVELS, CODEBOOK, seed=8)
    moved = ItemCatalog.from_codes(catalog.item_ids, (catalog.codes + 1) % CODEBOOK, CODEBOOK)
    engine = engine_on(folder, catalog)
    with pytest.raises(XgrError, match=r"other semantic IDs than the catalog it replaces.*'item0'"):
        engine.update_catalog(replace=moved)
    # Removed and added back in one update with other codes: a move too.
    other = ((catalog.codes[3] + 1) % CODEBOOK).tolist()
    with pytest.raises(XgrError, match=r"other semantic IDs than the catalog it replaces.*'item3'"):
        engine.update_catalog(remove=["item3"], add={"item3": other})
    assert engine.catalog_version == 1
    # With a training record, the record decides (here: the item left and came back moved).
    import shutil

    trained = tmp_path / "trained"
    shutil.copytree(folder, trained)
    catalog.write_model_metadata(trained, sequential_sid_map(LEVELS, CODEBOOK, OFFSET))
    engine = engine_on(trained, catalog)
    engine.update_catalog(remove=["item0"])
    with pytest.raises(XgrError, match="other semantic IDs than the model"):
        engine.update_catalog(add={"item0": tokens((catalog.codes[0] + 1) % CODEBOOK)})
    assert engine.catalog_version == 2


def test_concurrent_requests_each_see_one_version(folder):
    catalog = random_catalog(300, LEVELS, CODEBOOK, seed=9)
    engine = engine_on(folder, catalog)
    versions = {1: set(catalog.item_ids)}
    results, errors = [], []
    stop = threading.Event()

    def ask():
        while not stop.is_set():
            try:
                results.extend(engine.recommend(PROMPTS, **SEARCH))
            except Exception as exc:  # noqa: BLE001 - the test reports any
                errors.append(exc)

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for t in threads:
        t.start()
    rng = np.random.default_rng(0)
    for step in range(6):
        current = list(engine.catalog.item_ids)
        gone = list(rng.choice(current, 20, replace=False))
        new = {f"v{step}-{k}": rng.integers(0, CODEBOOK, LEVELS).tolist() for k in range(20)}
        number = engine.update_catalog(add=new, remove=gone)
        versions[number] = (set(current) - set(gone)) | set(new)
        if step % 3 == 2:
            number = engine.rollback_catalog()
        # Some requests run on this version before the next update (however slow they are).
        seen = len(results)
        for _ in range(3000):
            if len(results) >= seen + 2 * len(PROMPTS) or errors:
                break
            time.sleep(0.01)
    stop.set()
    for t in threads:
        t.join()
    assert not errors
    assert len({r.catalog_version for r in results}) > 1
    for result in results:
        assert {r.item_id for r in result.items} <= versions[result.catalog_version]
