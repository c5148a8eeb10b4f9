"""``xgr serve --ray`` (``serve_on_ray``), and ``serve run xgr.cli.ray_app:build key=value
...``: the Ray Serve application from Serve's own command line (``xgr.server.ray_serve``)."""

from __future__ import annotations

import os
import re
import signal
import threading
import uuid
from dataclasses import fields
from pathlib import Path
from typing import Any

import click

from xgr.cli.options import DEFAULT_CACHE, ModelSource, fail
from xgr.core import XgrError
from xgr.models.loader import DTYPES
from xgr.models.quantize import QUANTIZATIONS
from xgr.server.config import ServerConfig
from xgr.server.ray_replicas import hub, wait_idle
from xgr.server.ray_serve import DEPLOYMENT, PROXY_CALLBACK, ReplicaOptions, application


def serve_on_ray(
    source: ModelSource,
    config: ServerConfig,
    options: ReplicaOptions,
    host: str,
    port: int,
    warm_up_tokens: int,
) -> None:
    """The replicas' application on Ray Serve (the cluster ``RAY_ADDRESS`` names, else a
    local one) until SIGTERM or Ctrl-C; then, once the replicas have answered every request
    that came in (``wait_idle``), the application is deleted, and a local Ray with it (on a
    cluster, only the application and its hub go). Replicas the cluster cannot hold are
    refused.
    """
    hub_name = f"xgr-catalog-hub-{uuid.uuid4().hex}"
    try:
        app = application(source, config, options, warm_up_tokens, warm_up_tokens or 1000, hub_name)
        import ray
        from ray import serve
    except XgrError as exc:
        fail(exc)
    local = not os.environ.get("RAY_ADDRESS")
    # A local cluster's proxy answers 503 for a request whose replica died (inherited env).
    os.environ.setdefault(*PROXY_CALLBACK)
    ray.init(ignore_reinit_error=True, log_to_driver=False)
    stop = threading.Event()

    def interrupt(*_):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGINT):  # after ray.init, which sets its own
        signal.signal(sig, interrupt)
    deployed = False
    try:
        _refuse_unplaceable(ray.cluster_resources(), options)
        try:
            serve.start(http_options={"host": host, "port": port})
        except Exception as exc:  # noqa: BLE001 (Ray wraps the proxy's bind error)
            raise click.ClickException(f"Serve's proxy did not start on {host}:{port}: "
                                       f"{str(exc).strip().splitlines()[-1]}") from exc  # fmt: skip
        deployed = True
        try:
            serve.run(app, name="xgr", route_prefix="/")
        except RuntimeError as exc:
            raise click.ClickException(f"the replicas did not start: {_why(serve)}") from exc
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        count = options.replicas if not options.autoscaling else (
            f"{options.min_replicas}-{options.max_replicas}"
        )  # fmt: skip
        where = f"http://{host}:{port}" if local else "the cluster's Serve proxies"
        click.echo(f"xgr on Ray Serve at {where} ({count} replicas)")
        stop.wait()
    except KeyboardInterrupt:
        click.echo("stopping while the replicas start", err=True)
    finally:
        if deployed:
            # Requests queued at the proxy still reach the replicas until they are idle;
            # the deletion then waits for the replicas themselves.
            wait_idle(hub_name, options.graceful_shutdown_timeout_s)
            serve.delete("xgr")
            ray.kill(hub(hub_name))
        if local:
            serve.shutdown()
            ray.shutdown()


def _refuse_unplaceable(resources: dict, options: ReplicaOptions) -> None:
    """Refuse replicas the cluster cannot hold (Serve would wait for them forever)."""
    count = options.min_replicas if options.autoscaling else options.replicas
    for name, each in (
        ("GPU", options.num_gpus_per_replica),
        ("CPU", options.num_cpus_per_replica),
    ):
        have = resources.get(name, 0.0)
        if count * each > have:
            raise click.ClickException(
                f"{count} replica(s) of {each:g} {name} each need {count * each:g} {name} in "
                f"all; the Ray cluster has {have:g}"
            )


def _why(serve) -> str:
    """The deployment's own error (a replica's) from Serve's status."""
    try:
        deployment = serve.status().applications["xgr"].deployments[DEPLOYMENT]
    except Exception:  # noqa: BLE001 (Serve already gone: no better message)
        return "see the Ray logs"
    lines = [line for line in deployment.message.splitlines() if line.strip()]
    if not lines:
        return deployment.status
    # The message ends with the replica's traceback: its last line is the error itself.
    error = re.match(r"[\w.]+(?:Error|Exception): (.*)", lines[-1].strip())
    return error.group(1) if error else lines[-1].strip()


def build(args: dict[str, str]):
    """``serve run xgr.cli.ray_app:build key=value ...``'s application: ``model`` (a
    folder) or ``demo=true``, ``catalog``, ``dtype``, ``quantization``, ``device``,
    ``warm_up_tokens``, the ``ReplicaOptions`` and the ``ServerConfig`` fields, by name.

    Raises:
        XgrError: an unknown key, a value of the wrong type, neither or both of ``model``
            and ``demo``, a model folder or catalog that is not there, an unknown dtype,
            quantization or device.
    """
    args = dict(args)
    warm_up_tokens = _number(int, "warm_up_tokens", args.pop("warm_up_tokens", "0"))
    prompt_tokens = _number(int, "prompt_tokens", args.pop("prompt_tokens", "0")) or None
    source = ModelSource(
        demo=_flag(args.pop("demo", "false")),
        model_dir=Path(args.pop("model")) if "model" in args else None,
        catalog_paths=((None, Path(args.pop("catalog"))),) if "catalog" in args else (),
        dtype=args.pop("dtype", "float32"),
        device=args.pop("device", "cpu"),
        cache_dir=Path(args.pop("cache_dir", DEFAULT_CACHE)),
        quantization=args.pop("quantization", None),
    )
    _check(source)
    options = ReplicaOptions(**_typed(ReplicaOptions, args))
    config = ServerConfig(**_typed(ServerConfig, args))
    if args:
        raise XgrError(f"unknown arguments: {', '.join(sorted(args))}")
    return application(
        source, config, options, warm_up_tokens, prompt_tokens or warm_up_tokens or 1000
    )


def _typed(cls, args: dict[str, str]) -> dict[str, Any]:
    """The ``args`` naming fields of the dataclass ``cls``, converted to the fields' types
    (taken out of ``args``)."""
    out = {}
    for field in fields(cls):
        if field.name in args:
            text = args.pop(field.name)
            kind = str(field.type)
            if "int" in kind and "float" not in kind:
                out[field.name] = _number(int, field.name, text)
            elif "float" in kind:
                out[field.name] = _number(float, field.name, text)
            else:
                out[field.name] = text
    return out


def _number(kind: type, name: str, text: str):
    try:
        return kind(text)
    except ValueError as exc:
        raise XgrError(f"{name}={text!r}: {exc}") from exc


def _check(source: ModelSource) -> None:
    """Refuse here, before any replica starts, what every replica would refuse."""
    if source.demo == (source.model_dir is not None):
        raise XgrError("give model=DIR or demo=true (one of them)")
    paths = [p for _, p in source.catalog_paths]
    if source.model_dir is not None:
        paths.insert(0, source.model_dir)
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise XgrError(f"not found: {', '.join(missing)}")
    if source.dtype not in DTYPES:
        raise XgrError(f"dtype must be one of {', '.join(DTYPES)}, got {source.dtype!r}")
    if source.quantization not in (None, *QUANTIZATIONS):
        raise XgrError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or absent, "
                       f"got {source.quantization!r}")  # fmt: skip
    if source.device.split(":")[0] not in ("cpu", "cuda"):
        raise XgrError(f"device must be cpu or cuda, got {source.device!r}")


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise XgrError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")
