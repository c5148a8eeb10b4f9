"""The HTTP API through FastAPI's TestClient."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from tests.conftest import random_catalog, sequential_sid_map
from xgr import Engine
from xgr.engine.prompt import PromptFormat
from xgr.server.app import create_app


@pytest.fixture(scope="module")
def engine(model_dirs):
    catalog = random_catalog(300, 3, 16, seed=21)
    sid_map = sequential_sid_map(3, 16, 8)
    engine = Engine.from_pretrained(model_dirs["qwen2"], catalog=catalog, sid_token_ids=sid_map)
    engine.prompt_format = PromptFormat(prefix=(1,), max_history_items=20)
    return engine


@pytest.fixture(scope="module")
def client(engine):
    titles = {item: f"Title of {item}" for item in engine.catalog.item_ids}
    return TestClient(create_app(engine, titles))


def test_health(client):
    assert client.get("/health").json() == {"status": "ok"}


def test_recommend_matches_engine(client, engine):
    history = ["item3", "item17", "item250"]
    body = {"history": history, "beam_width": 16, "num_results": 5, "request_id": "r1"}
    response = client.post("/v1/recommend", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["request_id"] == "r1"
    prompt = engine.history_prompt(history)
    assert prompt[0] == 1 and len(prompt) == 1 + 3 * 3
    (expected,) = engine.recommend(
        [prompt], beam_width=16, top_k=16, num_results=5, exclude_item_ids=[set(history)]
    )
    assert [i["item_id"] for i in data["items"]] == [r.item_id for r in expected.items]
    first = data["items"][0]
    assert first["title"] == f"Title of {first['item_id']}"
    assert first["semantic_id"] == engine.catalog.format_semantic_id(expected.items[0].semantic_id)
    assert not set(history) & {i["item_id"] for i in data["items"]}
    timings = data["timings"]
    assert timings["total_ms"] >= timings["prefill_ms"] > 0


def test_semantic_id_and_integer_history(client, engine):
    sid = engine.catalog.format_semantic_id(engine.catalog.codes_of("item5"))
    by_sid = client.post("/v1/recommend", json={"history": [sid], "beam_width": 16}).json()
    by_id = client.post("/v1/recommend", json={"history": ["item5"], "beam_width": 16}).json()
    assert [i["item_id"] for i in by_sid["items"]] == [i["item_id"] for i in by_id["items"]]


def test_exclude_history_false_keeps_history_items(client):
    top = client.post("/v1/recommend", json={"history": ["item1"], "beam_width": 16}).json()
    best = top["items"][0]["item_id"]
    kept = client.post(
        "/v1/recommend", json={"history": [best], "beam_width": 16, "exclude_history": False}
    ).json()
    excluded = client.post("/v1/recommend", json={"history": [best], "beam_width": 16}).json()
    assert best not in {i["item_id"] for i in excluded["items"]}
    assert len(kept["items"]) >= len(excluded["items"])


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"history": ["nope", "item1", 12345]}, 400, "nope"),
        ({"history": ["<a_99><b_1><c_1>"]}, 400, "<a_99><b_1><c_1>"),
        ({"history": ["<a_1>"]}, 400, "<a_1>"),
        ({"history": []}, 422, "history"),
        ({"history": ["item1"], "beam_width": 0}, 422, "beam_width"),
        ({"history": ["item1"], "beam_width": 4, "num_results": 5}, 400, "num_results"),
        ({"history": ["item1"], "colour": "red"}, 422, "colour"),
        ({"history": "item1"}, 422, "history"),
    ],
)
def test_bad_requests_get_4xx_with_a_reason(client, body, status, fragment):
    response = client.post("/v1/recommend", json=body)
    assert response.status_code == status, response.text
    assert fragment in response.text


def test_malformed_json(client):
    response = client.post(
        "/v1/recommend", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"] == "invalid request body"
