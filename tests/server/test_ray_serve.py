"""xgr on Ray Serve (CPU): replicas' options and routing bound, and a local Ray cluster of two
replicas of a tiny model answering as the single-process server does."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import httpx
import pytest

from tests.server.test_live_server import random_requests, send_all
from xgr import XgrError
from xgr.cli.options import ModelSource
from xgr.cli.ray_app import build
from xgr.server.config import ServerConfig
from xgr.server.ray_replicas import labelled
from xgr.server.ray_serve import ReplicaOptions, routed_per_replica

TOKEN = "ray-serve-test-admin-token-0123"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def test_routed_per_replica_follows_the_token_budget():
    config = ServerConfig(max_batch_size=32, max_batch_tokens=20_000, default_beam_width=64)
    # 1,000-token prompts + 64 x 3 codes: 16 a batch; 2 in flight and 1 forming.
    assert routed_per_replica(config, 1000) == 16 * 3
    assert routed_per_replica(ServerConfig(max_batch_size=4), 1000) == 4 * 3
    assert routed_per_replica(ServerConfig(max_batch_size=4, streams=2), 1000) == 4 * 5
    assert routed_per_replica(ServerConfig(max_queue=5), 10) == 5
    assert routed_per_replica(ServerConfig(max_batch_tokens=100), 5000) == 3  # one a batch


def test_the_deployment_routes_each_replica_its_batches_and_queues_as_the_server(
    served_model_dir,
):
    """Serve holds at most ``max_queue`` requests per proxy beyond the replicas' share and
    answers more 429 with Retry-After (the server's own answer to a full queue)."""
    pytest.importorskip("ray.serve")
    from xgr.server.ray_serve import application

    source = ModelSource(False, Path(served_model_dir), (), "float32", "cpu", Path("/x"))
    config = ServerConfig(max_queue=7, max_batch_size=2)
    deployment = application(source, config, ReplicaOptions(replicas=2), 0, 60)._bound_deployment
    assert deployment.num_replicas == 2
    assert deployment.max_ongoing_requests == routed_per_replica(config, 60) == 2 * 3
    assert deployment.max_queued_requests == 7
    backpressure = deployment._deployment_config.backpressure_config
    assert (backpressure.status_code, backpressure.retry_after_s) == (429, 1.0)
    scaled = application(source, config, ReplicaOptions(min_replicas=1, max_replicas=3), 0, 60)
    autoscaling = scaled._bound_deployment._deployment_config.autoscaling_config
    assert (autoscaling.min_replicas, autoscaling.max_replicas) == (1, 3)
    assert autoscaling.target_ongoing_requests == 3  # half of what one replica is routed


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"replicas": 0}, "replicas must be a positive integer"),
        ({"replicas": True}, "replicas must be a positive integer"),
        ({"num_gpus_per_replica": -1}, "num_gpus_per_replica must be a number >= 0"),
        ({"min_replicas": 1}, "both min_replicas and max_replicas"),
        ({"min_replicas": 3, "max_replicas": 2}, "above max_replicas"),
        ({"target_ongoing_requests": 0}, "target_ongoing_requests must be a number > 0"),
        ({"num_gpus_per_replica": float("nan")}, "num_gpus_per_replica must be a number >= 0"),
        ({"num_cpus_per_replica": float("inf")}, "num_cpus_per_replica must be a number >= 0"),
        ({"replicas": 3, "min_replicas": 1, "max_replicas": 4}, "not both"),
        ({"target_ongoing_requests": 4}, "give min_replicas and max_replicas"),
        (
            {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": float("nan")},
            "target_ongoing_requests must be a number > 0",
        ),
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
    model = str(served_model_dir)
    for args, message in [
        ({"model": model, "warm_up_tokens": "abc"}, "warm_up_tokens='abc'"),
        ({"model": model, "warm_up_tokens": "-5"}, "warm_up_tokens must be an integer >= 0"),
        ({"model": model, "prompt_tokens": "-192"}, "prompt_tokens must be an integer >= 1"),
        ({"model": model, "graceful_shutdown_timeout_s": "nan"}, "must be a number >= 0"),
        ({}, "give model=DIR or demo=true"),
        ({"model": model, "demo": "true"}, "give model=DIR or demo=true"),
        ({"model": "/no/such/folder"}, "not found: /no/such/folder"),
        ({"model": model, "catalog": "/no/such.json"}, "not found: /no/such.json"),
        ({"model": model, "dtype": "float99"}, "dtype must be one of"),
        ({"model": model, "device": "tpu"}, "device must be cpu or cuda"),
    ]:
        with pytest.raises(XgrError, match=message):
            build(args)


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
    from xgr.server.ray_serve import PROXY_CALLBACK

    name, value = PROXY_CALLBACK
    before = os.environ.get(name)
    os.environ[name] = value  # the proxy started below inherits it
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        source = ModelSource(
            False, Path(served_model_dir), (), "float32", "cpu", Path("/nonexistent")
        )
        app = application(
            source,
            ServerConfig(max_batch_size=8, admin_token=TOKEN),
            ReplicaOptions(replicas=2, num_cpus_per_replica=1),
        )
        serve.run(app, name="xgr", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


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


def test_labelled_merges_the_replicas_metrics_under_one_family_each():
    from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    texts = {}
    for replica, served in (("a", 3), ("b", 5)):
        registry = CollectorRegistry()
        Counter("xgr:served", "Requests served.", ["model"], registry=registry).labels("m").inc(
            served
        )
        Gauge("xgr:version", 'A "quoted" help\nline.', registry=registry).set(2)
        texts[replica] = generate_latest(registry)
    merged = list(text_string_to_metric_families(labelled(texts).decode()))
    # prometheus_client writes a counter's creation time as a gauge family of its own.
    assert sorted(f.name for f in merged) == ["xgr:served", "xgr:served_created", "xgr:version"]
    assert next(f for f in merged if f.name == "xgr:version").documentation == (
        'A "quoted" help\nline.'
    )
    served = next(f for f in merged if f.name == "xgr:served")
    totals = {s.labels["replica"]: s.value for s in served.samples if s.name.endswith("_total")}
    assert totals == {"a": 3.0, "b": 5.0}
    assert all(s.labels["model"] == "m" for s in served.samples)


def test_metrics_of_every_replica_from_one_scrape(ray_url, engine):
    import asyncio
    import time

    from prometheus_client.parser import text_string_to_metric_families

    asyncio.run(send_all(ray_url, random_requests(engine.catalog, 30, seed=12)))
    deadline = time.monotonic() + 30
    while True:  # the replicas report every half second
        text = httpx.get(f"{ray_url}/metrics", timeout=30).text
        families = {f.name: f for f in text_string_to_metric_families(text)}
        success = families["xgr:request_success"].samples
        replicas = {s.labels["replica"] for s in success if s.name.endswith("_total")}
        if len(replicas) == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(replicas) == 2
    answered = sum(s.value for s in success if s.name.endswith("_total"))
    assert answered >= 30


def test_a_catalog_change_reaches_every_replica(ray_url, engine):
    import asyncio

    catalog = engine.catalog
    removed = catalog.item_ids[:150]
    update = httpx.post(
        f"{ray_url}/v1/catalog", json={"remove": removed}, headers=ADMIN, timeout=120
    )
    assert update.status_code == 200, update.text
    assert update.json()["catalog_version"] == 2 and update.json()["num_items"] == 150
    kept = catalog.item_ids[150:]
    bodies = [{**b, "history": [i for i in b["history"] if i in kept] or kept[:2]}
              for b in random_requests(catalog, 40, seed=13)]  # fmt: skip
    answers = asyncio.run(send_all(ray_url, bodies))
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["catalog_version"] == 2
        assert not {i["item_id"] for i in answer.json()["items"]} & set(removed)
    # A refused change changes nothing anywhere.
    refused = httpx.post(f"{ray_url}/v1/catalog", json={"remove": removed[:1]}, headers=ADMIN,
                         timeout=60)  # fmt: skip
    assert refused.status_code == 400 and "lacks" in refused.json()["error"]
    back = httpx.post(f"{ray_url}/v1/catalog/rollback", headers=ADMIN, timeout=120)
    assert back.status_code == 200 and back.json()["catalog_version"] == 1
    answers = asyncio.run(send_all(ray_url, random_requests(catalog, 20, seed=14)))
    assert all(a.status_code == 200 and a.json()["catalog_version"] == 1 for a in answers)


def test_a_killed_replica_loses_no_request_and_is_replaced(ray_url, engine):
    """Requests flow while one replica is killed: each is answered, 200 or 503 (never
    dropped), and Serve starts a replacement, which replays the catalog changes."""
    import asyncio
    import time

    import ray

    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith("SERVE_REPLICA::xgr#")]  # fmt: skip
    assert len(names) == 2
    victim = ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])
    bodies = random_requests(engine.catalog, 120, seed=15)

    async def flow():
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=ray_url, timeout=120, limits=limits) as client:

            async def one(body, delay):
                await asyncio.sleep(delay)
                return (await client.post("/v1/recommend", json=body)).status_code

            tasks = [one(b, i * 0.02) for i, b in enumerate(bodies)]
            killer = asyncio.get_running_loop().run_in_executor(
                None, lambda: (time.sleep(0.6), ray.kill(victim, no_restart=True))
            )
            statuses = await asyncio.gather(*tasks)
            await killer
            return statuses

    statuses = asyncio.run(flow())
    assert len(statuses) == len(bodies)
    assert set(statuses) <= {200, 503}, statuses
    assert statuses.count(200) >= len(bodies) // 2
    deadline = time.monotonic() + 90
    while httpx.get(f"{ray_url}/ready", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "no replacement replica"
        time.sleep(1)


def test_sigterm_drains_the_replicas(served_model_dir, engine):
    """``xgr serve --ray``: requests sent before SIGTERM are all answered 200, then the
    command exits."""
    import asyncio
    import signal
    import subprocess
    import sys
    import time

    pytest.importorskip("ray.serve")
    from tests.conftest import wait_until_ready

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "xgr.cli", "serve", "--ray", "--replicas", "2",
         "--model", str(served_model_dir), "--port", str(port), "--max-batch-size", "1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ready(url, 120), "the replicas did not start"
        bodies = [{**b, "beam_width": 256} for b in random_requests(engine.catalog, 30, seed=16)]

        async def flow():
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                sent = [asyncio.ensure_future(client.post("/v1/recommend", json=b)) for b in bodies]
                await asyncio.sleep(1.0)  # admitted, most still waiting in the replicas
                server.send_signal(signal.SIGTERM)
                return await asyncio.gather(*sent)

        answers = asyncio.run(flow())
        assert [a.status_code for a in answers] == [200] * len(bodies)
        started = time.monotonic()
        assert server.wait(timeout=60) == 0
        assert time.monotonic() - started < 60
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--num-gpus-per-replica", "1"], "need 1 GPU in all; the Ray cluster has 0"),
        (["--replicas", "0"], "Invalid value for '--replicas'"),
        (["--min-replicas", "1"], "both min_replicas and max_replicas"),
    ],
)
def test_serve_ray_refuses_what_it_cannot_run(served_model_dir, options, message):
    """Replicas the cluster cannot hold are refused at once (Serve would wait for them
    forever), as are bad options."""
    import subprocess
    import sys

    pytest.importorskip("ray.serve")
    if "GPU" in message:
        import torch

        if torch.cuda.is_available():
            pytest.skip("the local cluster has a GPU")
    run = subprocess.run(
        [sys.executable, "-m", "xgr.cli", "serve", "--ray", "--model", str(served_model_dir),
         "--port", "1", *options],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode != 0
    assert message in run.stderr, run.stderr[-2000:]


@pytest.mark.parametrize(
    ("path", "app_sends", "status", "retry_after", "error"),
    [
        ("/v1/recommend", None, 503, b"1", "stopped before answering: retry"),
        ("/v1/catalog", None, 503, None, "GET /v1/catalog shows the version"),
        ("/v1/recommend", (429, b"text/plain"), 429, b"1", "the queue is full"),
        ("/v1/recommend", (429, b"application/json"), 429, None, "the server's own"),
    ],
)
def test_the_proxy_middleware_answers_lost_and_refused_requests(
    path, app_sends, status, retry_after, error
):
    """A request whose replica died (the app ends without an answer) and Serve's own 429
    are answered in xgr's error form; an answer already in it passes unchanged."""
    import asyncio
    import json

    from xgr.server.ray_serve import AnswerLostRequests

    async def app(scope, receive, send):
        if app_sends is None:
            raise RuntimeError("the replica died")
        code, kind = app_sends
        headers = [(b"content-type", kind), (b"retry-after", b"1")] if kind == b"text/plain" else [
            (b"content-type", kind)
        ]  # fmt: skip
        await send({"type": "http.response.start", "status": code, "headers": headers})
        body = b"Request dropped" if kind == b"text/plain" else b'{"error": "the server\'s own"}'
        await send({"type": "http.response.body", "body": body})

    sent = []

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": path}
    asyncio.run(AnswerLostRequests(app)(scope, None, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    headers = dict(start["headers"])
    assert start["status"] == status
    assert headers.get(b"retry-after") == retry_after
    assert error in json.loads(body)["error"]


def test_concurrent_catalog_changes_each_make_one_version_everywhere(ray_url, engine):
    import asyncio

    catalog = engine.catalog
    removed = catalog.item_ids[-4:]  # four: the versions a rollback can return through

    async def changes():
        async with httpx.AsyncClient(base_url=ray_url, timeout=120, headers=ADMIN) as client:
            posts = [client.post("/v1/catalog", json={"remove": [i]}) for i in removed]
            return await asyncio.gather(*posts)

    answers = asyncio.run(changes())
    assert [a.status_code for a in answers] == [200] * len(removed), [a.text for a in answers]
    versions = sorted(a.json()["catalog_version"] for a in answers)
    assert versions == list(range(versions[0], versions[0] + len(removed)))
    kept = catalog.item_ids[:20]
    bodies = [{**b, "history": kept[:3]} for b in random_requests(catalog, 30, seed=17)]
    for answer in asyncio.run(send_all(ray_url, bodies)):
        assert answer.status_code == 200
        assert answer.json()["catalog_version"] == versions[-1]
        assert not {i["item_id"] for i in answer.json()["items"]} & set(removed)
    for _ in removed:  # back to where the other tests left it
        back = httpx.post(f"{ray_url}/v1/catalog/rollback", headers=ADMIN, timeout=120)
        assert back.status_code == 200
