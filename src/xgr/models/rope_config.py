"""RoPE settings of a decoder config.json, read as transformers 5 reads them.

transformers 5 calls the RoPE settings ``rope_parameters``; ``rope_scaling`` is their older
name, which it still reads and prefers when a file has both. A ``rope_theta`` inside them
takes precedence over a top-level one. xgr's rotary tables (``xgr.layers.rotary``) apply
plain RoPE with one base frequency to every layer, so every setting that would change that
is refused here rather than ignored.
"""

from __future__ import annotations

from typing import Any

from xgr.core import XgrError

ROPE_KEYS = ("rope_parameters", "rope_scaling")
SUPPORTED_ROPE_TYPES = ("default",)
_ABSENT = object()


def rope_theta_from_hf(raw: dict[str, Any], default: float, maximum: float) -> float:
    """The RoPE base frequency of a decoder ``config.json`` dict.

    Args:
        raw: the config dict.
        default: the base frequency when the file sets none.
        maximum: the largest base frequency accepted.

    Raises:
        XgrError: ``rope_parameters`` or ``rope_scaling`` not a JSON object; settings nested
            per layer type that differ between layer types; both keys present and
            disagreeing on any entry; ``rope_type`` and ``type`` disagreeing; a RoPE type
            other than ``SUPPORTED_ROPE_TYPES``; a top-level ``rope_theta`` disagreeing
            with the one inside them; a base frequency that is not a finite number in
            (0, ``maximum``].
    """
    top = raw.get("rope_theta")
    found = {}
    for key in ROPE_KEYS:
        value = raw.get(key)
        if value is None:
            continue
        if not isinstance(value, dict):
            raise XgrError(f"{key} must be a JSON object, got {value!r}")
        if value:  # transformers treats an empty object as absent
            found[key] = _normalized(key, value)
    if len(found) == 2:
        _check_agreement(found["rope_scaling"], found["rope_parameters"], top)
    key, rope = next(iter(found.items()), ("rope_parameters", {}))
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise XgrError(
            f"RoPE type {rope_type!r} ({key}) is not supported (only "
            f"{', '.join(map(repr, SUPPORTED_ROPE_TYPES))}): its scaling would not be applied"
        )
    inner = rope.get("rope_theta")
    if inner is not None and top is not None and inner != top:
        raise XgrError(
            f"rope_theta {top!r} disagrees with the rope_theta {inner!r} in {key}; keep one of them"
        )
    theta = next((t for t in (inner, top) if t is not None), default)
    if type(theta) not in (int, float) or not 0 < theta <= maximum:  # NaN fails it too
        raise XgrError(f"rope_theta must be a finite number in (0, {maximum:g}], got {theta!r}")
    return float(theta)


def _normalized(key: str, value: dict[str, Any]) -> dict[str, Any]:
    """One flat RoPE settings dict with its type under ``rope_type`` (``type`` is the older
    name), from a flat dict or one nested per layer type whose entries are all equal.

    Raises:
        XgrError: nested entries that differ, or ``rope_type`` and ``type`` disagreeing.
    """
    nested = {name: entry for name, entry in value.items() if isinstance(entry, dict)}
    if nested:
        entries = list(nested.values())
        if len(nested) != len(value) or any(entry != entries[0] for entry in entries):
            raise XgrError(
                f"{key} sets RoPE per layer type ({', '.join(sorted(nested))}) differently; "
                "xgr applies one RoPE to every layer"
            )
        value = entries[0]
    flat = dict(value)
    old = flat.pop("type", _ABSENT)
    new = flat.get("rope_type", _ABSENT)
    if old is not _ABSENT and new is not _ABSENT and old != new:
        raise XgrError(f"{key} has rope_type {new!r} but type {old!r}; keep one of them")
    flat["rope_type"] = next((t for t in (new, old) if t is not _ABSENT), "default")
    return flat


def _check_agreement(scaling: dict[str, Any], parameters: dict[str, Any], top: Any) -> None:
    """Refuse ``rope_scaling`` and ``rope_parameters`` that say different things.

    A base frequency missing from one of them is the top-level ``rope_theta``, as
    transformers fills it in.

    Raises:
        XgrError: naming each entry on which they differ and both values.
    """
    if top is not None:
        scaling = {"rope_theta": top, **scaling}
        parameters = {"rope_theta": top, **parameters}
    differ = [
        f"{name} ({_shown(scaling, name)} in rope_scaling, "
        f"{_shown(parameters, name)} in rope_parameters)"
        for name in sorted(scaling.keys() | parameters.keys())
        if scaling.get(name, _ABSENT) != parameters.get(name, _ABSENT)
    ]
    if differ:
        raise XgrError(
            f"rope_scaling and rope_parameters disagree on {'; '.join(differ)}; keep one of "
            "them (rope_parameters is the current name)"
        )


def _shown(settings: dict[str, Any], name: str) -> str:
    return repr(settings[name]) if name in settings else "unset"
