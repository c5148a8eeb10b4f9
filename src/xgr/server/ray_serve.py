"""xgr on Ray Serve: replicas of one model, each an ``Engine`` with xgr's own scheduler and
HTTP API on one GPU (or on CPUs), behind Serve's HTTP proxy (``application``).

Serve routes each request to a replica holding fewer than ``max_ongoing_requests``, bounded
from the replica's token budget (``routed_per_replica``), so that xgr's batching decides the
batches and Serve's queue only holds what every replica is already batching. A replica takes
requests once its constructor (model load, CUDA-graph warm-up, the catalog changes made so
far) has returned. The replicas share one ``CatalogHub`` actor (``RayReplicas``): ``/ready``
is 200 once every replica runs, ``/metrics`` labels every replica's samples, and an admin
catalog change is applied by every replica, in the order of the hub's log, before it is
answered. The proxy answers 503 for a request whose replica died (``AnswerLostRequests``).

    serve run xgr.cli.ray_app:build model=DIR replicas=2 num_gpus_per_replica=1

needs the ``ray[serve]`` extra (``pip install "xgr[ray]"``).
"""

from __future__ import annotations

import json
import logging
import math
import uuid
from dataclasses import dataclass
from typing import Any

from xgr.core import XgrError, positive_int
from xgr.server.config import ServerConfig
from xgr.server.ray_replicas import Counted, RayReplicas

logger = logging.getLogger(__name__)

DEPLOYMENT = "xgr"
# A replica's batches in flight besides the one being formed: its streams x the engine's
# default pipeline depth (``Engine.max_in_flight``).
PIPELINE_DEPTH = 2


@dataclass(frozen=True)
class ReplicaOptions:
    """How many replicas and what each takes.

    Attributes:
        replicas: replicas when not autoscaling.
        num_gpus_per_replica: GPUs of each (0: it runs on CPUs).
        num_cpus_per_replica: CPUs Ray reserves for each.
        min_replicas, max_replicas: autoscaling bounds (both, or neither: a fixed number).
        target_ongoing_requests: autoscaling's target of requests in a replica at once;
            default half of what it is routed at most.
        graceful_shutdown_timeout_s: how long a stopping replica may finish its requests (s).

    Raises:
        XgrError: a count below 1 (0 GPUs is allowed), bounds given alone or reversed.
    """

    replicas: int = 1
    num_gpus_per_replica: float = 0.0
    num_cpus_per_replica: float = 1.0
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    graceful_shutdown_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.replicas != 1 and self.min_replicas is not None:
            raise XgrError(
                "give replicas, or min_replicas and max_replicas (autoscaling), not both"
            )
        for name in ("replicas", "min_replicas", "max_replicas"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (0 if name == "min_replicas" else 1)):  # fmt: skip
                raise XgrError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_gpus_per_replica", "num_cpus_per_replica", "graceful_shutdown_timeout_s"):
            value = getattr(self, name)
            if not _finite(value) or value < 0:
                raise XgrError(f"{name} must be a number >= 0, got {value!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise XgrError("autoscaling needs both min_replicas and max_replicas")
        if self.min_replicas is not None and self.min_replicas > self.max_replicas:
            raise XgrError(
                f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}"
            )
        target = self.target_ongoing_requests
        if target is not None and (not _finite(target) or target <= 0):
            raise XgrError(f"target_ongoing_requests must be a number > 0, got {target!r}")
        if target is not None and not self.autoscaling:
            raise XgrError(
                "target_ongoing_requests is autoscaling's: give min_replicas and max_replicas"
            )

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def routed_per_replica(config: ServerConfig, prompt_tokens: int, levels: int = 3) -> int:
    """The most requests Serve routes to one replica at once: the requests its batches in
    flight and the one being formed hold, each batch as many as the token budget
    (``max_batch_tokens``) takes of requests of ``prompt_tokens`` searched with the
    default beam width, at most ``max_batch_size``; at most the replica's queue.

    Raises:
        XgrError: ``prompt_tokens`` is not an integer >= 1.
    """
    prompt_tokens = positive_int("prompt_tokens", prompt_tokens)
    per_request = prompt_tokens + config.default_beam_width * levels
    per_batch = max(1, min(config.max_batch_size, config.max_batch_tokens // per_request))
    return max(1, min(config.max_queue, per_batch * (config.streams * PIPELINE_DEPTH + 1)))


class XgrReplica:
    """One replica: the engine loaded and warmed up in the constructor, then xgr's app as
    the replica's ASGI app (``__serve_build_asgi_app__``, Serve's late-bound ingress).

    Args:
        source: the model: an object whose ``load(cuda_streams=...)`` gives the engine
            (``xgr.cli.options.ModelSource``: a folder or the demo, catalogs, dtype, device).
        config: the server's limits (each replica's own scheduler).
        warm_up_tokens: typical prompt length to capture CUDA graphs for (0: none).
        hub_name: the name of the application's ``CatalogHub`` actor.
    """

    def __init__(
        self, source: Any, config: ServerConfig, warm_up_tokens: int, hub_name: str
    ) -> None:
        from xgr.server.app import create_app

        self.engine = source.load(cuda_streams=config.streams)
        self.replicas = RayReplicas(hub_name)
        self.xgr_app = create_app(self.engine, config, self.replicas)
        if warm_up_tokens:
            beam = config.default_beam_width
            self.engine.warm_up(warm_up_tokens, beam, beam, config.max_batch_size)

    def __serve_build_asgi_app__(self):
        return Counted(self.xgr_app, self.replicas)


# The Serve proxy's callback that adds ``AnswerLostRequests`` (set where the cluster starts;
# ``xgr serve --ray`` sets it for its local one).
PROXY_CALLBACK = ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", f"{__name__}:proxy_middlewares")


class AnswerLostRequests:
    """ASGI middleware for Serve's HTTP proxy: a request whose replica died before answering
    (the proxy would end it with a bare 500) is answered 503, with ``Retry-After`` where a
    retry is safe (a search did not run to its end; a catalog change may have been logged,
    so its answer says where to look instead); Serve's own 429 (its queue full) is answered
    in xgr's error form."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started, refused = False, None

        async def sending(message) -> None:
            nonlocal started, refused
            if message["type"] == "http.response.start":
                started = True
                if message["status"] == 429 and not _is_json(message):
                    refused = message  # Serve's own queue full: answered below as the server's
                    return
            if refused is None:
                await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:
                raise
            logger.exception("a request's replica failed before answering")
        if refused is not None:
            error = "the queue is full: retry later"
            retry = [(k, v) for k, v in refused["headers"] if k.lower() == b"retry-after"]
            await _answer(send, 429, error, retry)
        elif not started:
            if scope["path"].startswith("/v1/catalog"):  # a change may have been logged
                error = "the replica stopped before answering: GET /v1/catalog shows the version"
                await _answer(send, 503, error, [])
            else:
                error = "the replica serving the request stopped before answering: retry"
                await _answer(send, 503, error, [(b"retry-after", b"1")])


def _is_json(start: dict) -> bool:
    types = [v for k, v in start.get("headers", []) if k.lower() == b"content-type"]
    return any(v.startswith(b"application/json") for v in types)


async def _answer(send, status: int, error: str, headers: list) -> None:
    """Send xgr's error form: ``{"error": ...}`` with ``status``."""
    body = json.dumps({"error": error}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode()), *headers]  # fmt: skip
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def proxy_middlewares() -> list:
    """``RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH``'s callback (``PROXY_CALLBACK``): the
    proxy's middlewares."""
    from starlette.middleware import Middleware

    return [Middleware(AnswerLostRequests)]


def application(
    source: Any,
    config: ServerConfig,
    options: ReplicaOptions,
    warm_up_tokens: int = 0,
    prompt_tokens: int = 1000,
    hub_name: str | None = None,
):
    """The Serve application of ``options.replicas`` xgr replicas (``serve.run`` it).

    Args:
        source: the model (``XgrReplica``).
        prompt_tokens: typical prompt length, for ``routed_per_replica``.
        hub_name: the name of the replicas' ``CatalogHub`` (default: a new one).

    Raises:
        XgrError: Ray Serve is not installed, or ``warm_up_tokens`` or ``prompt_tokens`` is
            not a count.
    """
    try:
        from ray import serve
    except ImportError as exc:
        raise XgrError('Ray Serve is not installed: pip install "xgr[ray]"') from exc
    from ray.serve.config import BackpressureConfig

    if (
        isinstance(warm_up_tokens, bool)
        or not isinstance(warm_up_tokens, int)
        or warm_up_tokens < 0
    ):
        raise XgrError(f"warm_up_tokens must be an integer >= 0, got {warm_up_tokens!r}")
    routed = routed_per_replica(config, prompt_tokens)
    actor = {"num_cpus": options.num_cpus_per_replica, "num_gpus": options.num_gpus_per_replica}
    scaling: dict[str, Any] = {"num_replicas": options.replicas}
    if options.autoscaling:
        scaling = {
            "autoscaling_config": {
                "min_replicas": options.min_replicas,
                "max_replicas": options.max_replicas,
                "target_ongoing_requests": options.target_ongoing_requests or max(1, routed / 2),
            }
        }
    deployment = serve.deployment(
        serve.ingress()(XgrReplica),
        name=DEPLOYMENT,
        ray_actor_options=actor,
        max_ongoing_requests=routed,
        # What waits beyond the replicas' share, at each proxy, is bounded as the server's
        # own queue, and more is answered as the server would: 429 with Retry-After.
        max_queued_requests=config.max_queue,
        backpressure_config=BackpressureConfig(status_code=429, retry_after_s=1),
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
        **scaling,
    )
    hub_name = hub_name or f"xgr-catalog-hub-{uuid.uuid4().hex}"
    return deployment.bind(source, config, warm_up_tokens, hub_name)
