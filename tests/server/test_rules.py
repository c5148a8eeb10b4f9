"""Item rules over HTTP: allow-lists, exclusions and attribute filters, their errors, and the
attributes the model card lists."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from xgr import Engine
from xgr.server.app import create_app


@pytest.fixture(scope="module")
def filtered(served_model_dir, tmp_path_factory):
    """An engine whose catalog has a category (string) and a price (float) per item."""
    engine = Engine.from_pretrained(served_model_dir)
    path = tmp_path_factory.mktemp("attributes") / "items.jsonl"
    lines = [
        f'{{"item_id": "{item}", "category": "{("Tools", "Lab")[row % 2]}", "price": {row % 50}}}'
        for row, item in enumerate(engine.catalog.item_ids)
    ]
    path.write_text("\n".join(lines) + "\n")
    engine.catalog.load_attributes(path)
    with TestClient(create_app(engine)) as client:
        yield engine, client


HISTORY = [f"item{i}" for i in range(5)]


def test_rules_reach_the_search_and_match_the_engine(filtered):
    engine, client = filtered
    (card,) = client.get("/v1/models").json()["data"]
    assert card["attributes"] == {"category": "string", "price": "int"}
    rules = {"filter": {"category": "Lab", "price": {"lt": 30}}, "exclude_items": ["item7"]}
    body = {"history": HISTORY, "beam_width": 16, "num_results": 4, **rules}
    answer = client.post("/v1/recommend", json=body)
    assert answer.status_code == 200, answer.text
    items = answer.json()["items"]
    assert items and answer.json()["complete"]
    rows = [engine.catalog.item_index[i["item_id"]] for i in items]
    assert all(r % 2 == 1 and r % 50 < 30 for r in rows) and "item7" not in {
        i["item_id"] for i in items
    }
    prompt = engine.history_prompt(HISTORY)
    exclude = set(HISTORY) | {"item7"}
    (want,) = engine.recommend(
        [prompt], 16, 16, 4, exclude_item_ids=[exclude], item_filter=[rules["filter"]]
    )
    assert [i["item_id"] for i in items] == [r.item_id for r in want.items]
    allowed = [f"item{i}" for i in range(10, 20)]
    body = {"history": HISTORY, "beam_width": 16, "num_results": 4, "allow_items": allowed}
    got = client.post("/v1/recommend", json=body).json()["items"]
    assert got and {i["item_id"] for i in got} <= set(allowed)


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"filter": {"colour": "red"}}, "unknown item attribute 'colour'"),
        ({"filter": {"price": {"about": 3}}}, "unknown operator 'about'"),
        ({"filter": {"price": "cheap"}}, "'price' is a number"),
        ({"filter": {"category": {"gt": 1}}}, "'gt' needs a numeric attribute"),
    ],
)
def test_bad_filters_are_400_naming_the_problem(filtered, rules, message):
    _, client = filtered
    answer = client.post("/v1/recommend", json={"history": HISTORY, **rules})
    assert answer.status_code == 400 and message in answer.json()["error"]


def test_rule_lists_are_typed(filtered):
    _, client = filtered
    answer = client.post("/v1/recommend", json={"history": HISTORY, "allow_items": "item1"})
    assert answer.status_code == 422
    answer = client.post("/v1/recommend", json={"history": HISTORY, "filter": ["x"]})
    assert answer.status_code == 422
