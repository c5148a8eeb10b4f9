"""Item rules inside the search: each request's result equals the search of an engine built on
the catalog restricted to the items passing that request's rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import sequential_sid_map, write_random_t5
from xgr import Engine, ItemCatalog, XgrError

OFFSET = 8
LEVELS, CODEBOOK = 3, 16
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def catalog_with_collisions(seed=3, num_items=500) -> ItemCatalog:
    """Random semantic IDs, then every fifth item given its neighbour's (collisions)."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(0, CODEBOOK, size=(num_items, LEVELS))
    codes[1::5] = codes[0::5][: len(codes[1::5])]
    return ItemCatalog.from_codes([f"item{i}" for i in range(num_items)], codes, CODEBOOK)


def write_attributes(catalog: ItemCatalog, path) -> None:
    """category (string), price (float), stock (int) and new (bool) for every other item."""
    lines = ["item_id,category,price,stock,new"]
    for row, item in enumerate(catalog.item_ids):
        if row % 7 == 3:
            continue  # items without attributes pass no condition but not_in
        category = ("Tools", "Lab", "Garden")[row % 3]
        lines.append(f"{item},{category},{(row * 37) % 100 + 0.5},{row % 11},{row % 2 == 0}")
    path.write_text("\n".join(lines) + "\n")


def restricted(catalog: ItemCatalog, keep) -> ItemCatalog | None:
    rows = [row for row, item in enumerate(catalog.item_ids) if keep(row, item)]
    if not rows:
        return None
    return ItemCatalog.from_codes(
        [catalog.item_ids[r] for r in rows], catalog.codes[rows], catalog.codebook_size
    )


def assert_equal_results(got, want):
    assert [codes for codes, _ in got.semantic_ids] == [codes for codes, _ in want.semantic_ids]
    np.testing.assert_allclose(
        [s for _, s in got.semantic_ids], [s for _, s in want.semantic_ids], rtol=0, atol=1e-4
    )
    assert [r.item_id for r in got.items] == [r.item_id for r in want.items]
    assert got.complete == want.complete


@pytest.fixture(params=["qwen2", "t5"])
def folder(request, model_dirs, tmp_path):
    if request.param == "t5":
        write_random_t5(tmp_path, "gated-gelu", False, vocab_size=OFFSET + LEVELS * CODEBOOK)
        return tmp_path
    return model_dirs[request.param]


def engine_on(folder, catalog, device):
    return Engine.from_pretrained(
        folder, catalog=catalog, sid_token_ids=sequential_sid_map(LEVELS, CODEBOOK, OFFSET),
        device=device,
    )  # fmt: skip


PROMPTS = [[9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]
SEARCH = dict(beam_width=16, top_k=16, num_results=6)


@pytest.mark.parametrize("device", DEVICES)
def test_rules_equal_the_search_of_the_restricted_catalog(folder, tmp_path, device):
    catalog = catalog_with_collisions()
    write_attributes(catalog, tmp_path / "attributes.csv")
    catalog.load_attributes(tmp_path / "attributes.csv")
    engine = engine_on(folder, catalog, device)
    (top,) = engine.recommend(PROMPTS[:1], **SEARCH)
    top_items = [r.item_id for r in top.items]
    attrs = catalog.attributes.columns
    category, price = attrs["category"], attrs["price"]
    tools, garden = category.vocabulary.index("Tools"), category.vocabulary.index("Garden")

    def has_value(column, row):
        return bool(column.present[row])

    cases = [
        # An allow-list of one semantic ID's first item only (its collision partner left out).
        (dict(allow_item_ids=[["item0", "item7", "item300"]]),
         lambda row, item: item in {"item0", "item7", "item300"}),
        # Fewer items than num_results.
        (dict(allow_item_ids=[["item2", "item3"]]), lambda row, item: item in {"item2", "item3"}),
        # The unfiltered top results excluded: num_results still come back.
        (dict(exclude_item_ids=[top_items]), lambda row, item: item not in top_items),
        # Attributes: only some items of a colliding semantic ID pass.
        (dict(item_filter=[{"category": {"in": ["Tools", "Lab"]}, "price": {"lt": 60}}]),
         lambda row, item: has_value(category, row) and category.values[row] != garden
         and price.values[row] < 60),
        (dict(item_filter=[{"category": "Tools", "new": True}]),
         lambda row, item: has_value(category, row) and category.values[row] == tools
         and bool(attrs["new"].values[row])),
        (dict(item_filter=[{"category": {"not_in": ["Garden"]}}], allow_item_ids=[top_items]),
         lambda row, item: item in top_items
         and not (has_value(category, row) and category.values[row] == garden)),
    ]  # fmt: skip
    for rules, keep in cases:
        (got,) = engine.recommend(PROMPTS[:1], **SEARCH, **rules)
        only = restricted(catalog, keep)
        (want,) = engine_on(folder, only, device).recommend(PROMPTS[:1], **SEARCH)
        assert_equal_results(got, want)
        assert got.complete == (len(only.semantic_ids) >= SEARCH["num_results"] or want.complete)
    # The excluded top results are refilled: as many semantic IDs as without rules.
    (refilled,) = engine.recommend(PROMPTS[:1], **SEARCH, exclude_item_ids=[top_items])
    assert refilled.complete and len(refilled.semantic_ids) == SEARCH["num_results"]


@pytest.mark.parametrize("device", DEVICES)
def test_rules_that_leave_nothing_return_nothing(folder, device):
    engine = engine_on(folder, catalog_with_collisions(), device)
    for rules in (dict(allow_item_ids=[["not-an-item"]]), dict(allow_item_ids=[[]])):
        (got,) = engine.recommend(PROMPTS[:1], **SEARCH, **rules)
        assert got.semantic_ids == [] and got.items == [] and not got.complete


@pytest.mark.parametrize("device", DEVICES)
def test_each_request_of_a_batch_keeps_its_own_rules(folder, device):
    catalog = catalog_with_collisions(seed=5)
    engine = engine_on(folder, catalog, device)
    allow = [None, [f"item{i}" for i in range(0, 500, 3)], None]
    exclude = [None, None, [f"item{i}" for i in range(100)]]
    batch = engine.recommend(PROMPTS, **SEARCH, allow_item_ids=allow, exclude_item_ids=exclude)
    for i, prompt in enumerate(PROMPTS):
        (alone,) = engine.recommend(
            [prompt], **SEARCH, allow_item_ids=[allow[i]], exclude_item_ids=[exclude[i]]
        )
        assert_equal_results(batch[i], alone)
    (plain,) = engine.recommend(PROMPTS[:1], **SEARCH)
    assert_equal_results(batch[0], plain)  # no rules: as without any


def test_rule_arguments_are_checked(model_dirs, tmp_path):
    catalog = catalog_with_collisions()
    engine = engine_on(model_dirs["qwen2"], catalog, "cpu")
    with pytest.raises(XgrError, match="unknown item attribute 'category'"):
        engine.recommend(PROMPTS[:1], item_filter=[{"category": "Tools"}])
    write_attributes(catalog, tmp_path / "attributes.csv")
    catalog.load_attributes(tmp_path / "attributes.csv")
    for spec, message in [
        ({"colour": "red"}, "unknown item attribute 'colour'"),
        ({"price": {"below": 3}}, "unknown operator 'below'"),
        ({"price": "cheap"}, "'price' is a number"),
        ({"category": {"lt": 3}}, "'lt' needs a numeric attribute"),
        ({"stock": 2.5}, "'stock' is an integer"),
        ({"new": "yes"}, "'new' is a boolean"),
        ({"category": {"in": "Tools"}}, "'in' takes a list"),
        ({"price": {"lt": float("nan")}}, "finite"),
        ("category", "must be an object"),
    ]:
        with pytest.raises(XgrError, match=message):
            engine.recommend(PROMPTS[:1], item_filter=[spec])
    with pytest.raises(XgrError, match="one entry per prompt"):
        engine.recommend(PROMPTS[:2], allow_item_ids=[["item1"]])
    with pytest.raises(XgrError, match=r"allow_item_ids\[0\] must be a list of item ids"):
        engine.recommend(PROMPTS[:1], allow_item_ids=["item1"])


def test_an_empty_filter_keeps_every_item_and_huge_numbers_compare_as_numbers(model_dirs, tmp_path):
    catalog = catalog_with_collisions()
    write_attributes(catalog, tmp_path / "attributes.csv")
    catalog.load_attributes(tmp_path / "attributes.csv")
    engine = engine_on(model_dirs["qwen2"], catalog, "cpu")
    (plain,) = engine.recommend(PROMPTS[:1], **SEARCH)
    (empty,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=[{}])
    assert_equal_results(empty, plain)
    # An integer column's equality with a value it cannot hold is refused by name.
    for spec in ({"stock": 2**70}, {"stock": {"in": [1, 2**63]}}):
        with pytest.raises(XgrError, match=r"'stock' is a 64-bit integer: \d+ is outside"):
            engine.recommend(PROMPTS[:1], item_filter=[spec])
    with pytest.raises(XgrError, match="beyond the float64 range"):
        engine.recommend(PROMPTS[:1], item_filter=[{"price": {"lt": 10**400}}])
    # Bounds beyond either column's range pass every item with a value, or none.
    has_value = {"stock": {"ge": 0}}
    (with_value,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=[has_value])
    for spec in (
        {"stock": {"lt": 2**70}}, {"stock": {"ge": -(2**64)}}, {"stock": {"lt": 1e308}},
        {"stock": {"lt": 1e20, "ge": -1e308}}, {"price": {"lt": 10**20}},
    ):  # fmt: skip
        (got,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=[spec])
        assert_equal_results(got, with_value)
    for spec in ({"stock": {"gt": 2**70}}, {"stock": {"le": -(2**64)}}, {"price": 10**19}):
        (none,) = engine.recommend(PROMPTS[:1], **SEARCH, item_filter=[spec])
        assert none.items == [] and not none.complete


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masks_are_built_without_host_sync(model_dirs, tmp_path):
    """The masks are built while the prefill runs: a wait for the stream would stall it."""
    from xgr.catalog.rules import request_rules

    catalog = catalog_with_collisions()
    write_attributes(catalog, tmp_path / "attributes.csv")
    catalog.load_attributes(tmp_path / "attributes.csv")
    engine = engine_on(model_dirs["qwen2"], catalog, "cuda")
    items = catalog.item_ids
    rules = request_rules(
        catalog, 3, allow_item_ids=[items[::3], None, None],
        exclude_item_ids=[None, items[:40], None],
        item_filter=[None, {"category": "Lab", "new": True},
                     {"price": {"lt": 30}, "category": {"in": ["Tools", "Garden"]}}],
    )  # fmt: skip
    want = engine.catalog_masks.masks(rules)  # the first: the catalog's tables reach the device
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = engine.catalog_masks.masks(rules)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert not bool(got[-1][0].all()) and bool(got[-1][0].any())
