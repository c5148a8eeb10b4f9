"""Two batches in flight through HTTP, with NumPy prompts and clients that go away: every
other request is answered as if alone, and the server keeps serving afterwards.

On the CPU an engine stand-in launches each batch into a thread of its own (two lanes, as an
engine on one CUDA stream has), so batches end in any order; on CUDA the real engine does.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from concurrent.futures import Future

import httpx
import numpy as np
import torch

from tests.conftest import live_server
from xgr import Engine
from xgr.server.app import create_app
from xgr.server.config import ServerConfig


class TwoLanes:
    """An engine whose launched batches run side by side, each finishing after a random
    pause, so a later batch often ends before an earlier one."""

    max_in_flight = 2

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.rng = random.Random(3)
        self.lock = threading.Lock()
        self.array_prompts = 0  # the server queues the NumPy arrays of Engine.token_ids

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def recommend_async(self, prompts, **search):
        with self.lock:
            self.array_prompts += sum(isinstance(p, np.ndarray) for p in prompts)
            pause = self.rng.uniform(0.0, 0.03)
        done: Future = Future()

        def run() -> None:
            time.sleep(pause)
            try:
                with self.lock:  # the CPU engine runs one call at a time
                    done.set_result(self.engine.recommend(prompts, **search))
            except Exception as exc:
                done.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return done


def served_engine(model_dir) -> Engine | TwoLanes:
    if torch.cuda.is_available():
        engine = Engine.from_pretrained(model_dir, device="cuda", dtype="float32")
        assert engine.max_in_flight == 2  # one stream, two batches queued on it
        return engine
    return TwoLanes(Engine.from_pretrained(model_dir))


async def send_with_cancellations(url: str, bodies: list[dict]) -> list:
    limits = httpx.Limits(max_connections=300)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [asyncio.ensure_future(client.post("/v1/recommend", json=b)) for b in bodies]
        rng = random.Random(5)
        for i in range(0, len(tasks), 6):  # a client that goes away, waiting or running
            await asyncio.sleep(rng.uniform(0.0, 0.02))
            tasks[i].cancel()
        return await asyncio.gather(*tasks, return_exceptions=True)


def test_two_batches_in_flight_with_cancelled_clients_keep_serving(served_model_dir):
    engine = served_engine(served_model_dir)
    catalog = engine.catalog
    rng = random.Random(1)
    bodies = [
        {"history": rng.sample(catalog.item_ids, rng.randint(2, 12)), "beam_width": 8,
         "num_results": 4}
        for _ in range(180)
    ]  # fmt: skip
    config = ServerConfig(max_batch_size=4, max_beam_width=64)
    with live_server(create_app(engine, config)) as url:
        outcomes = asyncio.run(send_with_cancellations(url, bodies))
        health = httpx.get(f"{url}/health", timeout=5)
        after = httpx.post(f"{url}/v1/recommend", json=bodies[1], timeout=30)
    cancelled = [o for o in outcomes if isinstance(o, asyncio.CancelledError)]
    answered = [
        (b, o) for b, o in zip(bodies, outcomes, strict=True) if isinstance(o, httpx.Response)
    ]
    # A request answered before its cancellation counts as answered.
    assert len(cancelled) + len(answered) == 180 and len(cancelled) >= 20
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    assert after.status_code == 200
    if isinstance(engine, TwoLanes):
        assert engine.array_prompts >= 150
    for body, response in answered:
        assert response.status_code == 200, response.text
        (alone,) = engine.recommend(
            [engine.history_prompt(body["history"])], beam_width=8, top_k=8, num_results=4,
            exclude_item_ids=[set(body["history"])],
        )  # fmt: skip
        assert [i["item_id"] for i in response.json()["items"]] == [r.item_id for r in alone.items]
