"""The HTTP form of a prompt's given input embeddings: base64 spans decoded into arrays, with
no pickles and no ``torch.load`` (``prompt_embeds`` of ``/v1/completions`` and
``/v1/recommend``)."""

from __future__ import annotations

import base64
import binascii
from typing import Any

import numpy as np
import torch

from xgr.client import WIRE_DTYPES
from xgr.core import InputTooLargeError, Prompt, XgrError

# Spans of one prompt; more are a 413.
MAX_PROMPT_SPANS = 1024


def decode_spans(spans: list[Any], max_rows: int) -> list[tuple[int, torch.Tensor]]:
    """(offset, (n, d) tensor) of each ``EmbedSpan`` (``xgr.server.schemas``).

    Args:
        spans: the request's spans (pydantic models with offset, shape, dtype, data).
        max_rows: the most rows a prompt has (the model's ``max_prompt_tokens``).

    Raises:
        InputTooLargeError: more than ``MAX_PROMPT_SPANS`` spans, or one of more rows than
            ``max_rows`` (413).
        XgrError: naming the span: data that is not base64, or whose byte count is not
            the shape's and dtype's (400).
    """
    if len(spans) > MAX_PROMPT_SPANS:
        raise InputTooLargeError(f"prompt_embeds: {len(spans)} spans, at most {MAX_PROMPT_SPANS}")
    out = []
    for i, span in enumerate(spans):
        rows, cols = span.shape
        if rows > max_rows:
            raise InputTooLargeError(
                f"prompt_embeds[{i}]: {rows} rows, more than the model's {max_rows} positions"
            )
        try:
            raw = base64.b64decode(span.data, validate=True)
        except (binascii.Error, ValueError):
            raise XgrError(f"prompt_embeds[{i}]: data is not base64") from None
        wire = np.dtype(WIRE_DTYPES[span.dtype])
        want = rows * cols * wire.itemsize
        if len(raw) != want:
            raise XgrError(
                f"prompt_embeds[{i}]: data holds {len(raw)} bytes; shape {[rows, cols]} of "
                f"{span.dtype} needs {want}"
            )
        values = torch.from_numpy(np.frombuffer(raw, dtype=wire).astype(wire.newbyteorder("=")))
        if span.dtype == "bfloat16":
            values = values.view(torch.int16).view(torch.bfloat16)
        out.append((span.offset, values.view(rows, cols)))
    return out


def embedded_prompt(token_ids: Any, spans: list[tuple[int, torch.Tensor]]) -> Prompt:
    """The ``xgr.Prompt`` of token ids with spans, or (``token_ids`` None) of one span at
    offset 0 that is the whole prompt.

    Raises:
        XgrError: without token ids, not exactly one span at offset 0.
    """
    if token_ids is not None:
        return Prompt(token_ids=token_ids, embeds=spans)
    if len(spans) != 1 or spans[0][0] != 0:
        raise XgrError(
            "prompt_embeds without a prompt must be one span at offset 0 (the whole prompt)"
        )
    return Prompt(embeds=spans[0][1])
