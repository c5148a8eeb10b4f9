"""xgr on Ray Serve: replicas of one model, each an ``Engine`` with xgr's own scheduler and
HTTP API on one GPU (or on CPUs), behind Serve's HTTP proxy (``application``).

Serve routes each request to a replica holding fewer than ``max_ongoing_requests``, bounded
from the replica's token budget (``routed_per_replica``), so that xgr's batching decides the
batches and Serve's queue only holds what every replica is already batching. A replica takes
requests once its constructor (model load and CUDA-graph warm-up) has returned; its
``/ready`` is 200 only once every replica of the deployment runs. On shutdown Serve stops
routing to a replica and waits for its requests to finish (``graceful_shutdown_timeout_s``).

    serve run xgr.cli.ray_app:build model=DIR replicas=2 num_gpus_per_replica=1

needs the ``ray[serve]`` extra (``pip install "xgr[ray]"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from xgr.core import XgrError
from xgr.server.config import ServerConfig

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
    """

    def __init__(self, source: Any, config: ServerConfig, warm_up_tokens: int) -> None:
        from xgr.server.app import create_app

        self.engine = source.load(cuda_streams=config.streams)
        self.xgr_app = create_app(self.engine, config, ready_also=_siblings_starting)
        if warm_up_tokens:
            beam = config.default_beam_width
            self.engine.warm_up(warm_up_tokens, beam, beam, config.max_batch_size)

    def __serve_build_asgi_app__(self):
        return self.xgr_app


def _siblings_starting() -> str | None:
    """Why the deployment is not yet whole (replicas starting, or fewer than its target),
    None once every replica runs."""
    from ray import serve

    context = serve.get_replica_context()
    status = serve.status().applications[context.app_name]
    deployment = status.deployments[context.deployment]
    states = dict(deployment.replica_states)
    running = states.pop("RUNNING", 0)
    if deployment.status != "HEALTHY" or any(states.values()):
        waiting = ", ".join(f"{n} {state.lower()}" for state, n in states.items() if n)
        return f"{running} replicas running, {waiting or 'the deployment is ' + deployment.status}"
    return None


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
        XgrError: Ray Serve is not installed, or an admin token is given (a catalog update
            would reach one replica only).
    """
    if config.admin_token is not None:
        raise XgrError(
            "the catalog admin API is not served on Ray Serve: an update would reach only the "
            "replica that received it"
        )
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
    return deployment.bind(source, config, warm_up_tokens)
