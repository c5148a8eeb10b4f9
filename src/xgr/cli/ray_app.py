"""``serve run xgr.cli.ray_app:build key=value ...``: the Ray Serve application of
``xgr serve --ray`` from Serve's own command line (``xgr.server.ray_serve``)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from xgr.cli.options import DEFAULT_CACHE, ModelSource
from xgr.core import XgrError
from xgr.server.config import ServerConfig
from xgr.server.ray_serve import ReplicaOptions, application


def build(args: dict[str, str]):
    """``serve run xgr.cli.ray_app:build key=value ...``'s application: ``model`` (a
    folder) or ``demo=true``, ``catalog``, ``dtype``, ``device``, ``warm_up_tokens``, the
    ``ReplicaOptions`` and the ``ServerConfig`` fields, by name.

    Raises:
        XgrError: an unknown key or a value of the wrong type.
    """
    args = dict(args)
    source = ModelSource(
        demo=_flag(args.pop("demo", "false")),
        model_dir=Path(args.pop("model")) if "model" in args else None,
        catalog_paths=((None, Path(args.pop("catalog"))),) if "catalog" in args else (),
        dtype=args.pop("dtype", "float32"),
        device=args.pop("device", "cpu"),
        cache_dir=Path(args.pop("cache_dir", DEFAULT_CACHE)),
    )
    warm_up_tokens = int(args.pop("warm_up_tokens", 0))
    prompt_tokens = int(args.pop("prompt_tokens", warm_up_tokens or 1000))
    options = ReplicaOptions(**_typed(ReplicaOptions, args))
    config = ServerConfig(**_typed(ServerConfig, args))
    if args:
        raise XgrError(f"unknown arguments: {', '.join(sorted(args))}")
    return application(source, config, options, warm_up_tokens, prompt_tokens)


def _typed(cls, args: dict[str, str]) -> dict[str, Any]:
    """The ``args`` naming fields of the dataclass ``cls``, converted to the fields' types
    (taken out of ``args``)."""
    out = {}
    for field in fields(cls):
        if field.name in args:
            text = args.pop(field.name)
            kind = str(field.type)
            try:
                if "int" in kind and "float" not in kind:
                    out[field.name] = int(text)
                elif "float" in kind:
                    out[field.name] = float(text)
                else:
                    out[field.name] = text
            except ValueError as exc:
                raise XgrError(f"{field.name}={text!r}: {exc}") from exc
    return out


def _flag(text: str) -> bool:
    if text.lower() not in ("true", "false", "1", "0"):
        raise XgrError(f"expected true or false, got {text!r}")
    return text.lower() in ("true", "1")
