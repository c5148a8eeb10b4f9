"""A real uvicorn server on 127.0.0.1: concurrency, batching and the Python client."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import httpx
import numpy as np
import pytest

from tests.conftest import live_server, wait_until_ready
from xgr import Client, Engine
from xgr.client import ServerError
from xgr.server.app import create_app


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
        assert data["complete"] is alone.complete
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
        assert result.complete is alone.complete is True
        # The answer carries items; the client rebuilds one semantic-ID entry per ID of them.
        expected_ids = list(dict.fromkeys(r.semantic_id for r in alone.items))
        assert [codes for codes, _ in result.semantic_ids] == expected_ids
        np.testing.assert_allclose(
            [r.score for r in result.items], [r.score for r in alone.items], atol=1e-4
        )
        with pytest.raises(ServerError, match="HTTP 400: unknown items in history: 'nope'"):
            client.recommend(["nope"])
        allowed = engine.catalog.item_ids[100:160]
        ruled = client.recommend(
            history, beam_width=16, num_results=4, allow_items=allowed, exclude_items=allowed[:5]
        )
        (alone,) = engine.recommend(
            [engine.history_prompt(history)], 16, 16, 4,
            exclude_item_ids=[set(history) | set(allowed[:5])], allow_item_ids=[allowed],
        )  # fmt: skip
        assert [r.item_id for r in ruled.items] == [r.item_id for r in alone.items]
        assert ruled.items and {r.item_id for r in ruled.items} <= set(allowed[5:])
        assert all(r.level_scores == () for r in result.items)
        scored = client.recommend(history, beam_width=16, num_results=4, return_level_scores=True)
        (alone,) = engine.recommend(
            [engine.history_prompt(history)], 16, 16, 4, exclude_item_ids=[set(history)]
        )
        for got, want in zip(scored.items, alone.items, strict=True):
            np.testing.assert_allclose(got.level_scores, want.level_scores, atol=1e-6)
        assert len(scored.level_scores) == len(scored.semantic_ids)


class HeldEngine:
    """An engine whose ``recommend`` and ``recommend_async`` wait for ``release`` (everything
    else delegates)."""

    def __init__(self, engine):
        import threading

        self._engine = engine
        self.release = threading.Event()
        self.release.set()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def recommend(self, *args, **kwargs):
        self.release.wait(30)
        return self._engine.recommend(*args, **kwargs)

    def recommend_async(self, *args, **kwargs):
        self.release.wait(30)
        return self._engine.recommend_async(*args, **kwargs)


def test_full_queue_answers_429_with_retry_after(engine):
    from concurrent.futures import ThreadPoolExecutor

    from xgr.server.config import ServerConfig

    held = HeldEngine(engine)
    app = create_app(held, ServerConfig(max_batch_size=1, max_queue=1))
    history = {"history": engine.catalog.item_ids[:3], "beam_width": 8, "num_results": 4}
    with live_server(app) as url, ThreadPoolExecutor(4) as pool:
        held.release.clear()
        running = pool.submit(httpx.post, f"{url}/v1/recommend", json=history, timeout=30)
        time.sleep(0.3)  # taken into the (held) batch
        waiting = pool.submit(httpx.post, f"{url}/v1/recommend", json=history, timeout=30)
        time.sleep(0.3)  # the one waiting place is taken
        refused = httpx.post(f"{url}/v1/recommend", json=history, timeout=30)
        held.release.set()
        assert refused.status_code == 429
        assert int(refused.headers["Retry-After"]) >= 1
        assert "waiting" in refused.json()["error"]
        assert running.result().status_code == waiting.result().status_code == 200


def test_sigterm_finishes_admitted_requests(served_model_dir):
    import socket
    import subprocess
    import sys

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "xgr.cli", "serve", "--model", str(served_model_dir),
         "--port", str(port), "--max-batch-size", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ready(url, 90), "server did not start"
        catalog = Engine.from_pretrained(served_model_dir).catalog
        # One request per batch: the queue is still long once all are admitted.
        bodies = [{**b, "beam_width": 256} for b in random_requests(catalog, 100, seed=5)]

        counted = ("num_requests_waiting", "num_requests_running", "request_success_total")

        async def load(client) -> dict[str, float]:
            """The server's waiting, running and answered requests (its /metrics)."""
            families = text_string_to_metric_families((await client.get("/metrics")).text)
            samples = {s.name: s.value for family in families for s in family.samples}
            return {name: samples.get(f"xgr:{name}", 0.0) for name in counted}

        async def send_all():
            limits = httpx.Limits(max_connections=len(bodies) + 1)
            async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
                tasks = [
                    asyncio.ensure_future(client.post("/v1/recommend", json=b)) for b in bodies
                ]
                # Signal once every request is admitted (a request the server has not read
                # yet when it stops listening is not its to finish).
                deadline = time.monotonic() + 60
                while sum((seen := await load(client)).values()) < len(bodies):
                    assert time.monotonic() < deadline, seen
                    await asyncio.sleep(0.01)
                server.send_signal(signal.SIGTERM)
                return seen, await asyncio.gather(*tasks, return_exceptions=True)

        at_signal, answers = asyncio.run(send_all())
        assert [getattr(a, "status_code", a) for a in answers] == [200] * len(bodies)
        assert at_signal["num_requests_waiting"] > 0  # work was still queued at the signal
        # uvicorn shuts down gracefully, then re-raises the signal as its exit status.
        assert server.wait(60) in (0, -signal.SIGTERM)
        assert b"Finished server process" in server.stderr.read()
    finally:
        if server.poll() is None:
            server.kill()


def test_an_unreachable_server_is_named_not_given_a_status():
    import socket

    with socket.socket() as sock:  # a port nothing listens on once the socket closes
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with Client(f"http://127.0.0.1:{port}", timeout=5) as client:
        with pytest.raises(ServerError, match=f"cannot reach http://127.0.0.1:{port}") as info:
            client.recommend(["1", "2"], beam_width=4, num_results=2)
    assert info.value.status == 0 and "HTTP" not in str(info.value)
