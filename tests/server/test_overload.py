"""Overload against a real ``xgr serve`` process: at twice its capacity the server keeps
answering at a good fraction of it, and every request gets an answer (200, 429 or 504)."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import wait_until_ready
from xgr import ItemCatalog
from xgr.bench import http_load


@pytest.fixture(scope="module")
def server(served_model_dir):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [
        sys.executable, "-m", "xgr.cli", "serve", "--model", str(served_model_dir),
        "--port", str(port), "--max-queue", "8", "--max-batch-size", "8",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        if not wait_until_ready(f"http://127.0.0.1:{port}", 120):
            process.kill()
            pytest.fail(f"xgr serve did not start: {process.stderr.read().decode()[-2000:]}")
        yield port
    finally:
        process.terminate()
        process.wait(30)


def requests(served_model_dir, port: int) -> list[bytes]:
    catalog = ItemCatalog.from_index_json(served_model_dir / "catalog.index.json")
    rng = random.Random(0)
    bodies = [
        {"history": rng.sample(catalog.item_ids, 12), "beam_width": 8, "num_results": 4,
         "deadline_ms": 1000}
        for _ in range(64)
    ]  # fmt: skip
    return http_load.request_bytes("127.0.0.1", port, bodies)


def test_twice_the_capacity_keeps_most_of_it_and_loses_nothing(server, served_model_dir):
    data = requests(served_model_dir, server)

    async def scenario():
        pool = http_load.Pool("127.0.0.1", server, timeout=20.0)
        await http_load.closed_loop(pool, data, 4, 1.0)  # warm
        began = time.perf_counter()
        full = await http_load.closed_loop(pool, data, 8, 2.5)  # within the queue
        capacity = http_load.summary(full, time.perf_counter() - began)
        over = await http_load.open_loop(pool, data, 2 * capacity["ok_per_s"], 3.0)
        pool.close()
        return capacity, http_load.summary(over, 3.0), pool.lost

    capacity, over, lost = asyncio.run(scenario())
    assert capacity["ok"] > 20 and capacity["statuses"] == {"200": capacity["ok"]}
    # Every request is answered: served, queue full or deadline refused; none lost.
    assert set(over["statuses"]) <= {"200", "429", "504"} and not lost, over
    assert over["statuses"].get("429", 0) + over["statuses"].get("504", 0) > 0  # overloaded
    # Refusals cost little: most of the capacity still goes to answers (a server whose
    # refusals cost as much as an answer falls to a few per cent of it).
    assert over["ok_per_s"] >= 0.5 * capacity["ok_per_s"], (capacity, over)
    assert over["p99_ms"] < 1500
