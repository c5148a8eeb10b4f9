"""Serving metrics in Prometheus format (prometheus-client), named as vLLM names them.

Every metric carries a ``model_name`` label and the ``xgr:`` prefix, e.g.
``xgr:e2e_request_latency_seconds``; those of requests and batches a ``catalog`` label too
(the catalog searched), and the success counter is exposed as
``xgr:request_success_total{finished_reason=...}``. ``xgr:catalog_version`` is each
catalog's current version.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LATENCY_BUCKETS = (
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class RequestTimes:
    """Seconds one request spent in each phase."""

    queue: float
    prefill: float
    decode: float
    e2e: float


class ServingMetrics:
    """The server's metrics, in their own registry (one per app, so tests stay independent).

    Args:
        model_name: value of every metric's ``model_name`` label.
        registry: where to register; a new one by default.
    """

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        by_catalog = ["model_name", "catalog"]
        reg = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"xgr:{name}", doc, by_catalog, buckets=buckets, registry=reg)

        self._e2e = histogram(
            "e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS
        )
        self._queue = histogram(
            "request_queue_time_seconds", "Time waiting for a batch.", LATENCY_BUCKETS
        )
        self._prefill = histogram(
            "request_prefill_time_seconds", "Prefill time of the batch.", LATENCY_BUCKETS
        )
        self._decode = histogram(
            "request_decode_time_seconds", "Decode time of the batch.", LATENCY_BUCKETS
        )
        self._prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt length (tokens).", TOKEN_BUCKETS
        )
        self._batch_size = histogram("batch_size", "Requests per engine call.", BATCH_BUCKETS)
        self._catalog_version = Gauge(
            "xgr:catalog_version", "The catalog's current version.", by_catalog, registry=reg
        )
        self._running = Gauge(
            "xgr:num_requests_running", "Requests in the running batch.", labels, registry=reg
        ).labels(model_name)
        self._waiting = Gauge(
            "xgr:num_requests_waiting", "Requests waiting for a batch.", labels, registry=reg
        ).labels(model_name)
        self._success = Counter(
            "xgr:request_success",
            "Requests answered.",
            ["model_name", "catalog", "finished_reason"],
            registry=reg,
        )
        self.model_name = model_name

    def observe_request(
        self, times: RequestTimes, prompt_tokens: int, reason: str, catalog: str
    ) -> None:
        """Record one answered request (times in seconds, prompt length in tokens) of the
        catalog named ``catalog``."""
        model = self.model_name
        self._e2e.labels(model, catalog).observe(times.e2e)
        self._queue.labels(model, catalog).observe(times.queue)
        self._prefill.labels(model, catalog).observe(times.prefill)
        self._decode.labels(model, catalog).observe(times.decode)
        self._prompt_tokens.labels(model, catalog).observe(prompt_tokens)
        self._success.labels(model, catalog, reason).inc()

    def observe_batch(self, size: int, catalog: str) -> None:
        self._batch_size.labels(self.model_name, catalog).observe(size)

    def set_catalog_version(self, catalog: str, version: int) -> None:
        self._catalog_version.labels(self.model_name, catalog).set(version)

    def set_load(self, running: int, waiting: int) -> None:
        self._running.set(running)
        self._waiting.set(waiting)
