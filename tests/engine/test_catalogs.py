"""Several catalogs served by one model: each searches as an engine built on it alone, has its
own versions and rules, and (CUDA) keeps its own graphs, so alternating costs no capture."""

from __future__ import annotations

import shutil
import threading

import numpy as np
import pytest
import torch

from tests.conftest import random_catalog, sequential_sid_map, write_random_model
from tests.engine.test_catalog_updates import PROMPTS, SEARCH, same_results, tokens
from xgr import Engine, ItemCatalog, XgrError

LEVELS, CODEBOOK, OFFSET = 3, 16, 8
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("catalogs")
    write_random_model(path, "qwen3", seed=4)
    return path


def engine_on(folder, catalog, device="cpu", **options):
    sid_map = sequential_sid_map(LEVELS, CODEBOOK, OFFSET)
    return Engine.from_pretrained(
        folder, catalog=catalog, sid_token_ids=sid_map, device=device, **options
    )


def two_catalogs():
    """Two markets: a shared part (same ids, same codes) and items of their own."""
    shared = random_catalog(200, LEVELS, CODEBOOK, seed=21)
    ids, codes = list(shared.item_ids), shared.codes
    rng = np.random.default_rng(22)
    us = ItemCatalog.from_codes(
        [*ids[:150], *(f"us{k}" for k in range(40))],
        np.concatenate([codes[:150], rng.integers(0, CODEBOOK, (40, LEVELS))]),
        CODEBOOK,
    )
    eu = ItemCatalog.from_codes(
        [*ids[100:], *(f"eu{k}" for k in range(60))],
        np.concatenate([codes[100:], rng.integers(0, CODEBOOK, (60, LEVELS))]),
        CODEBOOK,
    )
    return us, eu


@pytest.mark.parametrize("device", DEVICES)
def test_two_catalogs_answer_side_by_side_as_each_alone(folder, device):
    us, eu = two_catalogs()
    # One lane: its graphs are the ones counted.
    engine = engine_on(folder, {"us": us, "eu": eu}, device, pipeline_depth=1)
    assert list(engine.catalogs) == ["us", "eu"] and engine.default_catalog == "us"
    alone = {name: engine_on(folder, c, device) for name, c in (("us", us), ("eu", eu))}
    want = {name: e.recommend(PROMPTS, **SEARCH) for name, e in alone.items()}
    assert [r.item_id for r in want["us"][0].items] != [r.item_id for r in want["eu"][0].items]
    for _ in range(2):  # alternating, twice: the second round replays what the first made
        for name in ("us", "eu", "us"):
            got = engine.recommend(PROMPTS, **SEARCH, catalog=name)
            same_results(got, want[name])
            assert all(r.catalog == name and r.catalog_version == 1 for r in got)
            assert {r.item_id for r in got[0].items} <= set(engine.catalogs[name].catalog.item_ids)
        if device == "cuda" and _ == 0:
            captures = engine.graphs.captures
    same_results(engine.recommend(PROMPTS, **SEARCH), want["us"])  # the default
    if device == "cuda":
        assert engine.graphs.captures == captures  # each catalog's graphs kept
        # The catalogs' first-level codes are the same: one runner, its prefill graphs shared.
        specs = [engine.catalogs[name].current.spec for name in ("us", "eu")]
        assert specs[0].runner is specs[1].runner
        # A new version of one catalog: its old decode graphs go, the other's stay, and the
        # prefill graphs serve the new version too (its first-level codes are the same).
        retired = specs[1]
        engine.update_catalog(remove=[eu.item_ids[-1]], catalog="eu")
        prefill_keys = [k for k in engine.graphs.keys() if not hasattr(k, "first_levels_together")]
        engine.recommend(PROMPTS, **SEARCH, catalog="eu")
        assert engine.graphs.captures > captures
        owners = [key[0] for key in engine.graphs.cache.keys()]
        assert retired not in owners and specs[0] in owners
        assert engine.catalogs["eu"].current.spec.runner is specs[0].runner
        assert set(prefill_keys) <= set(engine.graphs.keys())
        captures = engine.graphs.captures
        engine.recommend(PROMPTS, **SEARCH, catalog="us")
        assert engine.graphs.captures == captures


def test_each_catalog_has_its_own_versions_and_rules(folder, tmp_path):
    us, eu = two_catalogs()
    engine = engine_on(folder, {"us": us, "eu": eu})
    first_eu = engine.recommend(PROMPTS, **SEARCH, catalog="eu")
    first_us = engine.recommend(PROMPTS, **SEARCH, catalog="us")
    gone = sorted({r.item_id for r in first_eu[0].items[:3]})
    assert engine.update_catalog(remove=gone, add={"eu-new": tokens([1, 2, 3])}, catalog="eu") == 2
    assert engine.catalogs["eu"].version == 2 and engine.catalogs["us"].version == 1
    after = engine.recommend(PROMPTS, **SEARCH, catalog="eu")
    assert all(r.catalog_version == 2 for r in after)
    assert not {r.item_id for r in after[0].items} & set(gone)
    same_results(engine.recommend(PROMPTS, **SEARCH, catalog="us"), first_us)  # untouched
    # Its own number sequence and rollback.
    assert engine.update_catalog(remove=[us.item_ids[0]]) == 2  # the default: "us"
    assert engine.rollback_catalog(catalog="eu") == 1
    same_results(engine.recommend(PROMPTS, **SEARCH, catalog="eu"), first_eu)
    assert engine.catalogs["us"].version == 2
    with pytest.raises(XgrError, match="no earlier catalog version of 'eu'"):
        engine.rollback_catalog(catalog="eu")
    # Rules read the named catalog's items.
    only = [i for i in eu.item_ids if i.startswith("eu")][:5]
    ruled = engine.recommend(PROMPTS[:1], **SEARCH, catalog="eu", allow_item_ids=[only])
    assert ruled[0].items and {r.item_id for r in ruled[0].items} <= set(only)
    none_in_us = engine.recommend(PROMPTS[:1], **SEARCH, catalog="us", allow_item_ids=[only])
    assert none_in_us[0].items == []  # those items are not in the US catalog
    # History prompts are built from the named catalog's codes.
    eu_only = next(i for i in eu.item_ids if i.startswith("eu"))
    assert engine.history_prompt([eu_only], catalog="eu")
    with pytest.raises(XgrError, match="unknown"):
        engine.history_prompt([eu_only])


@pytest.mark.parametrize(
    "catalog, message",
    [
        ({}, "non-empty mapping"),
        ({"": None}, "1-64 letters"),
        ({"a b": None}, "1-64 letters"),
        ({"x" * 65: None}, "1-64 letters"),
        ({"-x": None}, "starting with a letter or digit"),
        ({"us": "catalog.json"}, "catalog 'us' must be an ItemCatalog"),
        ({1: None}, "catalog names must be strings, got int"),
        ([("us", None)], "non-empty mapping"),
    ],
)
def test_bad_catalog_mappings_are_refused(folder, catalog, message):
    with pytest.raises(XgrError, match=message):
        engine_on(folder, catalog)


def test_unknown_names_are_refused_everywhere(folder):
    us, eu = two_catalogs()
    engine = engine_on(folder, {"us": us, "eu": eu})
    for call in (
        lambda: engine.recommend(PROMPTS, **SEARCH, catalog="asia"),
        lambda: engine.update_catalog(remove=[us.item_ids[0]], catalog="asia"),
        lambda: engine.rollback_catalog(catalog="asia"),
        lambda: engine.served_catalog(3),
    ):
        with pytest.raises(XgrError, match=r"no catalog named .*serves \['us', 'eu'\]"):
            call()
    assert engine.catalogs["us"].version == 1


def test_each_catalog_is_checked_against_the_training_record(folder, tmp_path):
    us, eu = two_catalogs()
    trained = tmp_path / "trained"
    shutil.copytree(folder, trained)
    us.write_model_metadata(trained, sequential_sid_map(LEVELS, CODEBOOK, OFFSET))
    engine_on(trained, {"us": us, "eu": eu})  # shared items keep their codes: accepted
    codes = eu.codes.copy()
    codes[0] = (codes[0] + 1) % CODEBOOK  # a shared item moved
    moved = ItemCatalog.from_codes(eu.item_ids, codes, CODEBOOK)
    with pytest.raises(XgrError, match=rf"catalog 'eu': .*{eu.item_ids[0]!r}"):
        engine_on(trained, {"us": us, "eu": moved})


def test_updates_of_one_catalog_leave_the_others_requests_alone(folder):
    us, eu = two_catalogs()
    engine = engine_on(folder, {"us": us, "eu": eu})
    want_us = engine.recommend(PROMPTS, **SEARCH, catalog="us")
    errors, answers = [], []
    stop = threading.Event()

    def ask():
        while not stop.is_set():
            try:
                answers.append(engine.recommend(PROMPTS, **SEARCH, catalog="us"))
            except Exception as exc:  # noqa: BLE001 - the test reports any
                errors.append(exc)

    thread = threading.Thread(target=ask)
    thread.start()
    rng = np.random.default_rng(3)
    for step in range(4):
        items = list(engine.catalogs["eu"].catalog.item_ids)
        engine.update_catalog(
            remove=list(rng.choice(items, 10, replace=False)),
            add={f"e{step}-{k}": rng.integers(0, CODEBOOK, LEVELS).tolist() for k in range(10)},
            catalog="eu",
        )
    stop.set()
    thread.join()
    assert not errors and answers
    for got in answers:
        same_results(got, want_us)
        assert all(r.catalog == "us" and r.catalog_version == 1 for r in got)
    assert engine.catalogs["eu"].version == 5


def test_a_replacement_or_a_shared_object_is_never_changed_under_another_catalog(folder, tmp_path):
    us, eu = two_catalogs()
    for name, catalog in (("us", us), ("eu", eu)):
        lines = ["item_id,price"] + [f"{i},{r if name == 'us' else 1000 + r}"
                                     for r, i in enumerate(catalog.item_ids)]  # fmt: skip
        (tmp_path / f"{name}.csv").write_text("\n".join(lines) + "\n")
        catalog.load_attributes(tmp_path / f"{name}.csv")
    engine = engine_on(folder, {"us": us, "eu": eu})
    shared = ItemCatalog.from_codes(us.item_ids[100:150], us.codes[100:150], CODEBOOK)
    engine.update_catalog(replace=shared, catalog="us")
    engine.update_catalog(replace=shared, catalog="eu")
    assert shared.attributes is None  # the caller's catalog is left as it was
    price = engine.catalogs["us"].catalog.attributes.columns["price"]
    eu_price = engine.catalogs["eu"].catalog.attributes.columns["price"]
    assert price.values[0] == 100 and eu_price.values[0] == 1000  # item100 is eu's row 0
    # A served version given back as a replacement, with new values: that version keeps its.
    served = engine.catalogs["us"].catalog
    engine.update_catalog(replace=served, set_attributes={"item100": {"price": 7}}, catalog="us")
    assert served.attributes.columns["price"].values[0] == 100
    engine.rollback_catalog(catalog="us")
    assert engine.catalogs["us"].catalog.attributes.columns["price"].values[0] == 100
    # One object under two names: attributes loaded into one do not reach the other.
    loaded = us.attributes
    twice = engine_on(folder, {"a": us, "b": us})
    twice.served_catalog("a").catalog.load_attributes(tmp_path / "us.csv")
    assert twice.served_catalog("a").catalog.attributes is not loaded
    assert twice.served_catalog("b").catalog.attributes is loaded


def test_history_prompt_takes_the_catalog_by_keyword(folder):
    us, eu = two_catalogs()
    engine = engine_on(folder, {"us": us, "eu": eu})
    with pytest.raises(TypeError):
        engine.history_prompt(["eu1"], False, "eu")
    with pytest.raises(XgrError, match="truncate must be True or False"):
        engine.history_prompt(["item1"], "eu")


def test_an_older_record_is_completed_by_the_catalog_matching_its_fingerprint(folder, tmp_path):
    import json

    us, eu = two_catalogs()
    older = tmp_path / "older"
    shutil.copytree(folder, older)
    (older / "xgr_catalog.json").write_text(json.dumps({"fingerprint": us.fingerprint}))
    engine = engine_on(older, {"us": us, "eu": eu})  # eu: new and removed items, by rule
    assert engine.training_record["items"][us.item_ids[0]] == us.codes[0].tolist()
    codes = eu.codes.copy()
    codes[0] = (codes[0] + 1) % CODEBOOK
    moved = ItemCatalog.from_codes(eu.item_ids, codes, CODEBOOK)
    with pytest.raises(XgrError, match=rf"catalog 'eu': .*{eu.item_ids[0]!r}"):
        engine_on(older, {"us": us, "eu": moved})
    with pytest.raises(XgrError, match="^catalog fingerprint .* does not match"):
        engine_on(older, {"eu": eu})  # none matches: the older record's refusal
