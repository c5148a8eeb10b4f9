"""A real uvicorn server on 127.0.0.1: concurrency, batching and the Python client."""

from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np
import pytest

from tests.conftest import live_server
from xgr import Client, Engine
from xgr.client import ServerError
from xgr.server.app import create_app


@pytest.fixture(scope="module")
def engine(served_model_dir):
    return Engine.from_pretrained(served_model_dir)


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(create_app(engine)) as url:
        yield url


def random_requests(catalog, count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    items = catalog.item_ids
    return [
        {
            "history": rng.sample(items, rng.randint(1, 12)),
            "beam_width": rng.choice([8, 16]),
            "num_results": rng.randint(1, 8),
            "request_id": f"req-{i}",
        }
        for i in range(count)
    ]


async def send_all(base_url: str, bodies: list[dict]) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:
        return await asyncio.gather(*(client.post("/v1/recommend", json=b) for b in bodies))


def test_200_concurrent_requests_each_equal_to_alone(base_url, engine):
    bodies = random_requests(engine.catalog, 200, seed=0)
    responses = asyncio.run(send_all(base_url, bodies))
    assert [r.status_code for r in responses] == [200] * 200
    metrics = httpx.get(f"{base_url}/metrics").text
    batch_count = next(
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("xgr:batch_size_count")
    )
    assert batch_count < 200  # concurrent requests shared engine calls
    for body, response in zip(bodies, responses, strict=True):
        data = response.json()
        assert data["request_id"] == body["request_id"]
        (alone,) = engine.recommend(
            [engine.history_prompt(body["history"])],
            beam_width=body["beam_width"],
            top_k=body["beam_width"],
            num_results=body["num_results"],
            exclude_item_ids=[set(body["history"])],
        )
        assert [i["item_id"] for i in data["items"]] == [r.item_id for r in alone.items]
        np.testing.assert_allclose(
            [i["score"] for i in data["items"]], [r.score for r in alone.items], atol=1e-4
        )


def test_client_returns_engine_results(base_url, engine):
    history = engine.catalog.item_ids[10:14]
    with Client(base_url) as client:
        assert client.health()
        result = client.recommend(history, beam_width=16, num_results=4)
        (alone,) = engine.recommend(
            [engine.history_prompt(history)],
            beam_width=16,
            top_k=16,
            num_results=4,
            exclude_item_ids=[set(history)],
        )
        assert [r.item_id for r in result.items] == [r.item_id for r in alone.items]
        assert [r.semantic_id for r in result.items] == [r.semantic_id for r in alone.items]
        assert [r.title for r in result.items] == [f"Title of {r.item_id}" for r in alone.items]
        np.testing.assert_allclose(
            [r.score for r in result.items], [r.score for r in alone.items], atol=1e-4
        )
        with pytest.raises(ServerError, match="HTTP 400: unknown items in history: 'nope'"):
            client.recommend(["nope"])
