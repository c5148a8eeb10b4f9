"""``xgr.Client``: a small HTTP client for a running ``xgr serve``."""

from __future__ import annotations

import base64
import math
import re
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import torch

from xgr.catalog.history import history_entries
from xgr.core import DEFAULT_CATALOG, Recommendation, RecommendResult, XgrError

_CODE = re.compile(r"<[a-z]+_(\d+)>")


class ServerError(XgrError):
    """The server refused a request; ``status`` is its HTTP status code (0: no answer)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


class Client:
    """Talks to ``xgr serve``.

    Args:
        base_url: the server's root, e.g. ``"http://127.0.0.1:8000"``.
        timeout: seconds to wait for an answer.

    Raises:
        XgrError: a URL that is not http(s), or a timeout that is not a finite number of
            seconds above 0.
    """

    def __init__(self, base_url: str, timeout: float = 60.0) -> None:
        url = base_url.strip() if isinstance(base_url, str) else ""
        if not url.lower().startswith(("http://", "https://")):
            raise XgrError(f"server URL must start with http:// or https://, got {base_url!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise XgrError(f"timeout must be a number of seconds, got {timeout!r}")
        if not math.isfinite(timeout) or timeout <= 0:
            raise XgrError(f"timeout must be a finite number of seconds above 0, got {timeout!r}")
        self._http = httpx.Client(base_url=url.rstrip("/"), timeout=float(timeout))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def recommend(
        self,
        history: Sequence[str | int],
        beam_width: int = 64,
        top_k: int | None = None,
        num_results: int = 10,
        exclude_history: bool = True,
        truncate_history: bool = False,
        deadline_ms: float | None = None,
        request_id: str | None = None,
        exclude_items: Sequence[str | int] | None = None,
        allow_items: Sequence[str | int] | None = None,
        item_filter: dict | None = None,
        return_level_scores: bool = False,
        prompt_embeds: Sequence[tuple[int, Any]] | None = None,
        catalog: str | None = None,
    ) -> RecommendResult:
        """``POST /v1/recommend``; the same result type as ``Engine.recommend`` gives, except
        that ``semantic_ids`` lists only the IDs of the returned items (the answer does not
        carry the IDs whose items were all excluded).

        ``exclude_items``, ``allow_items`` and ``item_filter`` are the request's item rules
        (the body's ``exclude_items``, ``allow_items`` and ``filter``). With
        ``return_level_scores`` the items carry ``level_scores`` (else they are empty).
        ``prompt_embeds``: (offset, (n, hidden_size) array) spans of input embeddings over
        positions of the prompt the server builds from the history. ``catalog``: the name
        of the catalog to recommend from (default: the server's first); the result names
        the catalog and version searched.

        Raises:
            ServerError: the server answered with an error (its message included), or could
                not be reached (status 0).
        """
        body = {
            "history": [h.item() if hasattr(h, "item") else h for h in history_entries(history)],
            "beam_width": beam_width,
            "top_k": top_k,
            "num_results": num_results,
            "exclude_history": exclude_history,
            "truncate_history": truncate_history,
            "deadline_ms": deadline_ms,
            "request_id": request_id,
            "exclude_items": _plain_ids(exclude_items),
            "allow_items": _plain_ids(allow_items),
            "filter": _plain_json(item_filter),
            "return_level_scores": return_level_scores or None,
            "prompt_embeds": _spans_json(prompt_embeds),
            "catalog": catalog,
        }
        # numpy scalars (ids or sizes read from arrays) are not JSON: plain Python values.
        body = {k: v.item() if hasattr(v, "item") else v for k, v in body.items() if v is not None}
        data = self._post("/v1/recommend", body)
        try:
            items = [
                Recommendation(
                    item["item_id"],
                    float(item["score"]),
                    tuple(int(c) for c in _CODE.findall(item["semantic_id"])),
                    item.get("title"),
                    tuple(float(v) for v in item.get("level_scores") or ()),
                )
                for item in data["items"]
            ]
            timings = data["timings"]
            # Items of one semantic ID are adjacent and share its score: one entry per ID.
            # The answer carries items only, so IDs whose items were all excluded are absent
            # (``Engine.recommend`` lists them).
            first = {}  # the first item of each semantic ID, in order
            for r in items:
                first.setdefault((r.semantic_id, r.score), r)
            return RecommendResult(
                items=items,
                semantic_ids=list(first),
                level_scores=[r.level_scores for r in first.values()],
                prefill_ms=timings["prefill_ms"],
                decode_ms=timings["decode_ms"],
                complete=bool(data.get("complete", True)),
                **_catalog_of(data),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ServerError(
                200, f"{self._http.base_url} did not answer as an xgr server ({exc!r})"
            ) from exc

    def complete(
        self,
        prompt: str | Sequence[int] | None = None,
        n: int = 1,
        beam_width: int | None = None,
        prompt_embeds: Sequence[tuple[int, Any]] | Any | None = None,
        catalog: str | None = None,
    ) -> RecommendResult:
        """``POST /v1/completions`` for one prompt: its ``n`` best semantic IDs with their
        scores (``semantic_ids``) and their items (``items``, in that order).

        Args:
            prompt: text with semantic-ID tokens, or token ids; None for a prompt made only
                of embeddings.
            prompt_embeds: (offset, (n, hidden_size) array) spans of input embeddings over
                the prompt's positions; without a prompt, one (n, hidden_size) array.
            catalog: the catalog's name (default: the server's first).

        Raises:
            ServerError: the server's error (its message included), or no server.
        """
        if (
            prompt is None
            and prompt_embeds is not None
            and not isinstance(prompt_embeds, list | tuple)
        ):
            prompt_embeds = [(0, prompt_embeds)]
        body = {
            "prompt": prompt if prompt is None or isinstance(prompt, str) else _plain_ids(prompt),
            "n": n,
            "beam_width": beam_width,
            "prompt_embeds": _spans_json(prompt_embeds),
            "catalog": catalog,
        }
        body = _plain_json({k: v for k, v in body.items() if v is not None})
        data = self._post("/v1/completions", body)
        return self._choices_result(data, lambda c: c["text"])

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        n: int = 1,
        beam_width: int | None = None,
        top_k: int | None = None,
        catalog: str | None = None,
    ) -> RecommendResult:
        """``POST /v1/chat/completions``: the conversation through the model's chat template,
        its ``n`` best semantic IDs and their items, as ``complete`` gives them, from the
        catalog named ``catalog`` (default: the server's first).

        Raises:
            ServerError: the server's error (its message included), or no server.
        """
        body = {
            "messages": list(messages), "n": n, "beam_width": beam_width, "top_k": top_k,
            "catalog": catalog,
        }  # fmt: skip
        body = _plain_json({k: v for k, v in body.items() if v is not None})
        data = self._post("/v1/chat/completions", body)
        return self._choices_result(data, lambda c: c["message"]["content"])

    def _choices_result(self, data: dict, text_of) -> RecommendResult:
        """A completion's choices as a ``RecommendResult``."""
        try:
            result = RecommendResult(
                prompt_tokens=int(data["usage"]["prompt_tokens"]), **_catalog_of(data)
            )
            for choice in data["choices"]:
                codes = tuple(int(c) for c in _CODE.findall(text_of(choice)))
                score = float(choice["score"])
                result.semantic_ids.append((codes, score))
                result.items.extend(Recommendation(i, score, codes) for i in choice["item_ids"])
            return result
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ServerError(
                200, f"{self._http.base_url} did not answer as an xgr server ({exc!r})"
            ) from exc

    def health(self) -> bool:
        """True when ``GET /ready`` answers 200 (the server has warmed up); False if unreachable."""
        try:
            return self._http.get("/ready").status_code == 200
        except httpx.HTTPError:
            return False

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise ServerError(0, f"cannot reach {self._http.base_url}: {exc}") from exc
        except (TypeError, ValueError) as exc:  # NaN, infinities, objects JSON cannot hold
            raise XgrError(f"request body cannot be sent as JSON: {exc}") from exc
        if response.status_code != 200:
            try:
                data = response.json()
                message = data.get("error", response.text) if isinstance(data, dict) else None
                if isinstance(data, dict) and isinstance(data.get("detail"), list):
                    # A 422 names each field the schema refused.
                    fields = "; ".join(
                        f"{'.'.join(str(p) for p in d.get('loc') or [])}: {d.get('msg')}"
                        for d in data["detail"]
                        if isinstance(d, dict) and isinstance(d.get("loc") or [], list)
                    )
                    message = f"{message} ({fields})" if fields else message
            except ValueError:
                message = None
            if response.status_code == 404 and self._http.base_url.path.strip("/"):
                message = (
                    f"{message or 'Not Found'} (the server URL has a path, "
                    f"{self._http.base_url.path!r}: give the server's root)"
                )
            raise ServerError(response.status_code, message or response.text[:500])
        try:
            data = response.json()
        except ValueError as exc:
            raise ServerError(
                200, f"{self._http.base_url} answered {path} with a body that is not JSON"
            ) from exc
        if not isinstance(data, dict):
            raise ServerError(200, f"{self._http.base_url} answered {path} with no JSON object")
        return data


def _spans_json(spans: Sequence[tuple[int, Any]] | None) -> list[dict] | None:
    """prompt_embeds spans as the body's JSON objects (``encode_span``); None stays None."""
    if spans is None:
        return None
    if isinstance(spans, str) or not isinstance(spans, Sequence):
        raise XgrError("prompt_embeds must be a list of (offset, values) spans")
    out = []
    for span in spans:
        if not isinstance(span, Sequence) or len(span) != 2:
            raise XgrError("each prompt_embeds span must be an (offset, values) pair")
        out.append(encode_span(*span))
    return out


def _plain_json(value):
    """``value`` with NumPy scalars (in dicts, lists and tuples) as the Python values they
    hold, so that it encodes as JSON."""
    if isinstance(value, dict):
        return {k: _plain_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain_json(v) for v in value]
    return value.item() if hasattr(value, "item") and not isinstance(value, str) else value


def _plain_ids(ids: Sequence[str | int] | None) -> list | None:
    """Item ids as JSON values (NumPy scalars as Python ones); None stays None."""
    return None if ids is None else [i.item() if hasattr(i, "item") else i for i in ids]


# Little-endian element type of each dtype name of a prompt_embeds span; bfloat16 travels as
# its 16-bit pattern.
WIRE_DTYPES = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}


def encode_span(offset: int, values: Any) -> dict:
    """The JSON form of one span (``xgr.Client``): an (n, d) float32, float16 or bfloat16
    array (NumPy or torch) as its little-endian bytes in base64.

    Raises:
        XgrError: an offset that is not an int, or values that are not a 2-D array of one
            of those dtypes (NumPy: in the machine's byte order).
    """
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu()
        if values.dtype == torch.bfloat16:
            name, array = "bfloat16", values.view(torch.int16).numpy().astype("<u2")
        elif values.dtype in (torch.float32, torch.float16):
            array = values.numpy()
            name = "float32" if values.dtype == torch.float32 else "float16"
        else:
            raise XgrError(f"span values must be float32, float16 or bfloat16, got {values.dtype}")
    elif isinstance(values, np.ndarray) and values.dtype in (np.float32, np.float16):
        array, name = values, "float32" if values.dtype == np.float32 else "float16"
    else:
        raise XgrError(
            "span values must be a float32 or float16 NumPy array in the machine's byte order, "
            "or a float32, float16 or bfloat16 torch tensor"
        )
    if array.ndim != 2:
        raise XgrError(f"span values must be (n, hidden_size), got shape {array.shape}")
    data = np.ascontiguousarray(array, dtype=np.dtype(WIRE_DTYPES[name]))
    if isinstance(offset, bool) or not isinstance(offset, int | np.integer):
        raise XgrError(f"a span's offset must be an int, got {offset!r}")
    return {
        "offset": int(offset),
        "shape": [int(n) for n in array.shape],
        "dtype": name,
        "data": base64.b64encode(data.tobytes()).decode("ascii"),
    }


def _catalog_of(data: dict) -> dict[str, Any]:
    """The catalog name and version an answer names (``RecommendResult`` fields)."""
    return {
        "catalog": str(data.get("catalog", DEFAULT_CATALOG)),
        "catalog_version": int(data.get("catalog_version", 1)),
    }
