"""xgr on Ray Serve (CPU): replicas' options and routing bound, and a local Ray cluster of two
replicas of a tiny model answering as the single-process server does."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from tests.server.test_live_server import random_requests, send_all
from xgr import XgrError
from xgr.cli.options import ModelSource
from xgr.cli.ray_app import build
from xgr.server.config import ServerConfig
from xgr.server.ray_serve import ReplicaOptions, routed_per_replica


def test_routed_per_replica_follows_the_token_budget():
    config = ServerConfig(max_batch_size=32, max_batch_tokens=20_000, default_beam_width=64)
    # 1,000-token prompts + 64 x 3 codes: 16 a batch; 2 in flight and 1 forming.
    assert routed_per_replica(config, 1000) == 16 * 3
    assert routed_per_replica(ServerConfig(max_batch_size=4), 1000) == 4 * 3
    assert routed_per_replica(ServerConfig(max_batch_size=4, streams=2), 1000) == 4 * 5
    assert routed_per_replica(ServerConfig(max_queue=5), 10) == 5
    assert routed_per_replica(ServerConfig(max_batch_tokens=100), 5000) == 3  # one a batch


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replicas": 0}, "replicas must be a positive integer"),
        ({"replicas": True}, "replicas must be a positive integer"),
        ({"num_gpus_per_replica": -1}, "num_gpus_per_replica must be a number >= 0"),
        ({"min_replicas": 1}, "both min_replicas and max_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "above max_replicas"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests must be a number > 0"),
    ],
)
def test_replica_options_refuse_bad_values(options, message):
    with pytest.raises(XgrError, match=message):
        ReplicaOptions(**options)


def test_build_refuses_unknown_and_malformed_arguments(served_model_dir):
    pytest.importorskip("ray.serve")
    with pytest.raises(XgrError, match="unknown arguments: colour"):
        build({"model": str(served_model_dir), "colour": "red"})
    with pytest.raises(XgrError, match="replicas='two'"):
        build({"model": str(served_model_dir), "replicas": "two"})
    with pytest.raises(XgrError, match="expected true or false"):
        build({"demo": "maybe"})
    with pytest.raises(XgrError, match="admin API is not served on Ray Serve"):
        build({"model": str(served_model_dir), "admin_token": "a-token-of-32-characters-at-least"})


@pytest.fixture(scope="module")
def ray_url(served_model_dir):
    """Two CPU replicas of the served model on a local Ray cluster, Serve's proxy on a free
    port."""
    ray = pytest.importorskip("ray")
    serve = pytest.importorskip("ray.serve")
    from xgr.server.ray_serve import application

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        source = ModelSource(
            False, Path(served_model_dir), (), "float32", "cpu", Path("/nonexistent")
        )
        app = application(
            source,
            ServerConfig(max_batch_size=8),
            ReplicaOptions(replicas=2, num_cpus_per_replica=1),
        )
        serve.run(app, name="xgr", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def test_two_replicas_answer_as_the_single_process_server(ray_url, base_url, engine):
    ready = httpx.get(f"{ray_url}/ready", timeout=30)
    assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    bodies = random_requests(engine.catalog, 40, seed=11)
    import asyncio

    on_ray = asyncio.run(send_all(ray_url, bodies))
    alone = asyncio.run(send_all(base_url, bodies))
    for body, got, want in zip(bodies, on_ray, alone, strict=True):
        assert got.status_code == want.status_code == 200, got.text
        got, want = got.json(), want.json()
        assert got["request_id"] == body["request_id"]
        assert [i["item_id"] for i in got["items"]] == [i["item_id"] for i in want["items"]]
        assert [i["score"] for i in got["items"]] == pytest.approx(
            [i["score"] for i in want["items"]], abs=1e-5
        )
        assert got["catalog_version"] == want["catalog_version"] == 1
    # Errors come back as the replica gave them.
    bad = httpx.post(f"{ray_url}/v1/recommend", json={"history": ["no-such-item"]}, timeout=30)
    assert bad.status_code == 400 and "no-such-item" in bad.json()["error"]
