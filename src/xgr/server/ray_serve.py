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

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from xgr.core import XgrError
from xgr.server.config import ServerConfig

logger = logging.getLogger(__name__)

DEPLOYMENT = "xgr"
REPORT_S = 0.5  # how often a replica reports to the hub and applies the others' changes
STALE_S = 10.0  # a replica not heard from for this long is left out (it died)
LEASE_S = 120.0  # the longest one catalog change may take across the replicas
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
        for name in ("replicas", "min_replicas", "max_replicas"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (0 if name == "min_replicas" else 1)):  # fmt: skip
                raise XgrError(f"{name} must be a positive integer, got {value!r}")
        for name in ("num_gpus_per_replica", "num_cpus_per_replica", "graceful_shutdown_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
                raise XgrError(f"{name} must be a number >= 0, got {value!r}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise XgrError("autoscaling needs both min_replicas and max_replicas")
        if self.min_replicas is not None and self.min_replicas > self.max_replicas:
            raise XgrError(
                f"min_replicas {self.min_replicas} is above max_replicas {self.max_replicas}"
            )
        target = self.target_ongoing_requests
        if target is not None and (isinstance(target, bool) or not isinstance(target, int | float)
                                   or target <= 0):  # fmt: skip
            raise XgrError(f"target_ongoing_requests must be a number > 0, got {target!r}")

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None


def routed_per_replica(config: ServerConfig, prompt_tokens: int, levels: int = 3) -> int:
    """The most requests Serve routes to one replica at once: the requests its batches in
    flight and the one being formed hold, each batch as many as the token budget
    (``max_batch_tokens``) takes of requests of ``prompt_tokens`` searched with the
    default beam width, at most ``max_batch_size``; at most the replica's queue."""
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
        return self.xgr_app


class CatalogHub:
    """What the replicas of one application share, held by one Ray actor (``hub``): the
    log of catalog changes in the order they were made, the lease that lets one replica at a
    time make one, and each replica's last report (changes applied, metrics text)."""

    def __init__(self) -> None:
        self.log: list[Any] = []
        self.holder: tuple[str, float] | None = None  # (replica, since: monotonic s)
        self.reports: dict[str, dict] = {}

    def acquire(self, replica: str) -> bool:
        """Take the lease (True), unless another replica holds it (a lease older than
        ``LEASE_S`` is taken back: its holder died)."""
        now = time.monotonic()
        if self.holder is not None and self.holder[0] != replica and now - self.holder[1] < LEASE_S:
            return False
        self.holder = (replica, now)
        return True

    def release(self, replica: str) -> None:
        if self.holder is not None and self.holder[0] == replica:
            self.holder = None

    def append(self, replica: str, change: Any) -> int:
        """Log a change the lease holder applied; its number (from 1)."""
        if self.holder is None or self.holder[0] != replica:
            raise XgrError("a catalog change was logged without the lease")
        self.log.append(change)
        return len(self.log)

    def since(self, applied: int) -> list[tuple[int, Any]]:
        """The changes after the first ``applied``, numbered."""
        return list(enumerate(self.log[applied:], start=applied + 1))

    def report(self, replica: str, applied: int, metrics: bytes, failed: str | None) -> None:
        self.reports[replica] = {
            "applied": applied, "metrics": metrics, "failed": failed, "at": time.monotonic(),
        }  # fmt: skip

    def live(self) -> dict[str, dict]:
        """The reports of the replicas heard from in the last ``STALE_S`` (the others are
        forgotten)."""
        now = time.monotonic()
        self.reports = {r: v for r, v in self.reports.items() if now - v["at"] < STALE_S}
        return self.reports


class RayReplicas:
    """``xgr.server.replicas.Replicas`` on Ray Serve: the siblings are the deployment's
    replicas, their shared state the application's ``CatalogHub`` actor. A thread reports
    this replica every ``REPORT_S`` and applies the changes the others logged."""

    def __init__(self, hub_name: str) -> None:
        from ray import serve

        context = serve.get_replica_context()
        self.app_name, self.deployment = context.app_name, context.deployment
        self.id = context.replica_id.unique_id
        self.hub = hub(hub_name)
        self.applied = 0
        self.failed: str | None = None
        self._apply = None
        self._metrics = None
        self._lock = threading.Lock()  # one catch-up at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, apply, metrics) -> None:
        self._apply, self._metrics = apply, metrics
        self._catch_up()
        self._report()
        self._thread = threading.Thread(target=self._follow, name="xgr-replicas", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _follow(self) -> None:
        while not self._stop.wait(REPORT_S):
            try:
                self._catch_up()
                self._report()
            except Exception:  # the hub unreachable for a while: try again next time
                logger.exception("replica %s: reporting to the catalog hub failed", self.id)

    def _catch_up(self) -> None:
        """Apply the changes logged since this replica's last (in order)."""
        import ray

        with self._lock:
            for number, change in ray.get(self.hub.since.remote(self.applied)):
                if self._apply is None:
                    self.failed = "the admin API is off here: catalog changes cannot be applied"
                else:
                    try:
                        self._apply(change)
                    except XgrError as exc:  # the replica that made it applied it
                        self.failed = f"change {number}: {exc}"
                        logger.error("replica %s: %s", self.id, self.failed)
                self.applied = number

    def _report(self) -> None:
        import ray

        ray.get(self.hub.report.remote(self.id, self.applied, self._metrics(), self.failed))

    def waiting(self) -> str | None:
        from ray import serve

        status = serve.status().applications[self.app_name]
        deployment = status.deployments[self.deployment]
        states = dict(deployment.replica_states)
        running = states.pop("RUNNING", 0)
        if deployment.status != "HEALTHY" or any(states.values()):
            waiting = ", ".join(f"{n} {state.lower()}" for state, n in states.items() if n)
            return f"{running} replicas running, {waiting or 'deployment ' + deployment.status}"
        return None

    def metrics(self, own: bytes) -> bytes:
        import ray

        texts = {r: v["metrics"] for r, v in ray.get(self.hub.live.remote()).items()}
        texts[self.id] = own
        return labelled(texts)

    def change(self, change, apply):
        import ray

        deadline = time.monotonic() + LEASE_S
        while not ray.get(self.hub.acquire.remote(self.id)):
            if time.monotonic() > deadline:
                raise XgrError("another replica's catalog change has not ended: try again")
            time.sleep(0.05)
        try:
            self._catch_up()  # the others' changes first: the same order everywhere
            with self._lock:
                answer = apply(change)  # refused: nothing logged, nothing changed
                self.applied = ray.get(self.hub.append.remote(self.id, change))
        finally:
            self.hub.release.remote(self.id)
        self._report()
        self._wait_applied(self.applied)
        return answer

    def _wait_applied(self, number: int) -> None:
        """Until every replica heard from has applied change ``number``.

        Raises:
            XgrError: one failed to apply it, or they did not within ``LEASE_S``.
        """
        import ray

        deadline = time.monotonic() + LEASE_S
        while True:
            reports = ray.get(self.hub.live.remote())
            failed = [f"{r}: {v['failed']}" for r, v in reports.items() if v["failed"]]
            if failed:
                raise XgrError(f"replicas failed to apply catalog changes: {'; '.join(failed)}")
            behind = [r for r, v in reports.items() if v["applied"] < number]
            if not behind:
                return
            if time.monotonic() > deadline:
                raise XgrError(f"replicas {', '.join(behind)} did not apply the change in time")
            time.sleep(REPORT_S / 4)


def hub(name: str):
    """The ``CatalogHub`` actor of this name, made by the first replica that asks; detached,
    so that it outlives any one replica (each ``application`` names a new one)."""
    import ray

    remote = ray.remote(num_cpus=0)(CatalogHub)
    return remote.options(name=name, get_if_exists=True, lifetime="detached").remote()


def labelled(texts: dict[str, bytes]) -> bytes:
    """Several replicas' Prometheus texts as one, each sample labelled ``replica``."""
    from prometheus_client.parser import text_string_to_metric_families
    from prometheus_client.utils import floatToGoString

    families: dict[str, tuple[str, str, list[str]]] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text.decode()):
            _, _, lines = families.setdefault(family.name, (family.documentation, family.type, []))
            for sample in family.samples:
                labels = {**sample.labels, "replica": replica}
                shown = ",".join(f'{k}="{_escaped(v)}"' for k, v in labels.items())
                lines.append(f"{sample.name}{{{shown}}} {floatToGoString(sample.value)}")
    out = []
    for name, (documentation, kind, lines) in families.items():
        shown = f"{name}_total" if kind == "counter" else name  # as prometheus_client writes it
        out += [f"# HELP {shown} {_escaped(documentation, quote=False)}", f"# TYPE {shown} {kind}"]
        out += lines
    return ("\n".join(out) + "\n").encode()


def _escaped(text: str, quote: bool = True) -> str:
    text = text.replace("\\", "\\\\").replace("\n", "\\n")
    return text.replace('"', '\\"') if quote else text


# The Serve proxy's callback that adds ``AnswerLostRequests`` (set where the cluster starts;
# ``xgr serve --ray`` sets it for its local one).
PROXY_CALLBACK = ("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", f"{__name__}:proxy_middlewares")


class AnswerLostRequests:
    """ASGI middleware for Serve's HTTP proxy: a request whose replica died before answering
    (the proxy would end it with a bare 500) is answered 503 with ``Retry-After``, as any
    request the server could not take, so the client retries it elsewhere; it did not run
    to its end, so a retry does not run it twice."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception:
            if started:
                raise
            logger.exception("a request's replica failed before answering")
        if not started:
            body = b'{"error":"the replica serving the request stopped before answering: retry"}'
            headers = [(b"content-type", b"application/json"), (b"retry-after", b"1"),
                       (b"content-length", str(len(body)).encode())]  # fmt: skip
            await send({"type": "http.response.start", "status": 503, "headers": headers})
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
):
    """The Serve application of ``options.replicas`` xgr replicas (``serve.run`` it).

    Args:
        source: the model (``XgrReplica``).
        prompt_tokens: typical prompt length, for ``routed_per_replica``.

    Raises:
        XgrError: Ray Serve is not installed.
    """
    try:
        from ray import serve
    except ImportError as exc:
        raise XgrError('Ray Serve is not installed: pip install "xgr[ray]"') from exc
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
        graceful_shutdown_timeout_s=options.graceful_shutdown_timeout_s,
        **scaling,
    )
    return deployment.bind(source, config, warm_up_tokens, f"xgr-catalog-hub-{uuid.uuid4().hex}")
