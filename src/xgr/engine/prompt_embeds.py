"""The checks of an ``xgr.Prompt``'s given input embeddings, and their conversion to the
model's dtype (``Engine.prompt_input``)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from xgr.core import Prompt, XgrError

# dtypes a span may come in (NumPy has no bfloat16; torch tensors may be any of these).
SPAN_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def prompt_parts(prompt: Prompt) -> tuple[Any, list[tuple[Any, Any]]]:
    """A ``Prompt``'s token ids (placeholders for a prompt of embeddings only) and its
    (offset, values) spans, unchecked but for their form.

    Raises:
        XgrError: ``embeds`` neither a list of (offset, values) pairs nor, without token
            ids, one array.
    """
    embeds = prompt.embeds
    if isinstance(prompt.token_ids, Prompt):
        raise XgrError("Prompt.token_ids must be token ids, not another Prompt")
    if prompt.token_ids is None:
        if _is_array(embeds):
            values = _as_tensor(embeds, "the prompt's embeds")
            if values.dim() != 2 or not values.shape[0]:
                raise XgrError(
                    f"a prompt of embeddings only takes an (n, hidden_size) array with n >= 1, "
                    f"got shape {tuple(values.shape)}"
                )
            return np.zeros(values.shape[0], dtype=np.int64), [(0, values)]
        raise XgrError(
            "a Prompt without token_ids takes one (n, hidden_size) array as embeds, got "
            f"{type(embeds).__name__}"
        )
    if _is_array(embeds) or not isinstance(embeds, Sequence) or isinstance(embeds, str):
        raise XgrError(
            "Prompt.embeds with token_ids must be a list of (offset, values) spans, got "
            f"{type(embeds).__name__}"
        )
    spans = []
    for i, span in enumerate(embeds):
        if not isinstance(span, Sequence) or isinstance(span, str) or len(span) != 2:
            raise XgrError(f"embedding span {i} must be an (offset, values) pair")
        spans.append((span[0], span[1]))
    return prompt.token_ids, spans


def checked_spans(
    spans: list[tuple[Any, Any]], num_tokens: int, hidden: int, dtype: torch.dtype
) -> list[tuple[int, torch.Tensor]]:
    """The spans of a prompt of ``num_tokens`` tokens as (offset, (n, hidden) contiguous CPU
    tensor in the span's own dtype), sorted by offset: their values fit the model's
    ``dtype``, to which the batch packing converts them as it copies them.

    Raises:
        XgrError: naming the span: an offset that is not an int in range, values that are
            not a 2-D float32 / bfloat16 / float16 array of ``hidden`` columns and at least
            one row, rows past the prompt's end, NaN or infinite values, or two spans that
            overlap.
    """
    out = []
    for i, (offset, values) in enumerate(spans):
        name = f"embedding span {i} (offset {offset!r})"
        if isinstance(offset, bool) or not isinstance(offset, numbers.Integral):
            raise XgrError(f"{name}: the offset must be an int")
        offset = int(offset)
        if not _is_array(values):
            raise XgrError(f"{name}: values must be a NumPy array or a torch tensor")
        rows = _as_tensor(values, name)
        if rows.dim() != 2 or rows.shape[1] != hidden or not rows.shape[0]:
            raise XgrError(
                f"{name}: values must be (n, {hidden}) with n >= 1 (the model's hidden "
                f"size), got shape {tuple(rows.shape)}"
            )
        if not 0 <= offset or offset + rows.shape[0] > num_tokens:
            raise XgrError(
                f"{name}: rows {offset}..{offset + rows.shape[0] - 1} are outside the "
                f"prompt's {num_tokens} positions"
            )
        rows = rows.contiguous()
        largest = largest_magnitude(rows)
        if not largest <= torch.finfo(dtype).max:  # NaN compares false too
            what = (
                f"overflow the model's dtype {dtype}"
                if math.isfinite(largest)
                else "hold NaN or infinite entries"
            )
            raise XgrError(f"{name}: values {what}")
        out.append((offset, rows, i))
    out.sort(key=lambda span: span[0])
    for (a, rows_a, i), (b, _, j) in zip(out, out[1:], strict=False):
        if a + rows_a.shape[0] > b:
            first, second = sorted((i, j))
            raise XgrError(f"embedding spans {first} and {second} overlap (offsets {a} and {b})")
    return [(offset, rows) for offset, rows, _ in out]


# An IEEE float's bit pattern with the sign cleared orders as its magnitude does, infinity
# above every finite value and NaN above infinity: its largest is the largest magnitude.
_MAGNITUDE_BITS = {
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.float16: (torch.int16, 0x7FFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
}


def largest_magnitude(values: torch.Tensor) -> float:
    """The largest absolute value of a contiguous float32 / float16 / bfloat16 CPU tensor:
    inf or NaN where it holds one (NaN where it holds both).

    One NumPy pass over the values' bits, on the calling thread: torch's reductions spread
    a span's few hundred thousand values over the intra-op threads, which on a many-core
    host costs more than the work.
    """
    bits_dtype, mask = _MAGNITUDE_BITS[values.dtype]
    top = np.bitwise_and(values.view(bits_dtype).numpy(), mask).max()
    return float(torch.tensor(int(top), dtype=bits_dtype).view(values.dtype))


def _is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray | torch.Tensor)


def _as_tensor(values: Any, name: str) -> torch.Tensor:
    """A CPU tensor of the values, in their own dtype (refusing others)."""
    if isinstance(values, np.ndarray):
        if isinstance(values, np.ma.MaskedArray):  # its masked entries would escape the checks
            raise XgrError(f"{name}: values must be a plain array, not a masked one")
        if values.dtype not in (np.float32, np.float16):
            raise XgrError(
                f"{name}: values must be float32 or float16 NumPy arrays in the machine's byte "
                f"order (bfloat16 as a torch tensor), got NumPy {values.dtype.str}"
            )
        values = torch.from_numpy(np.ascontiguousarray(values))
    elif values.dtype not in SPAN_DTYPES:
        raise XgrError(f"{name}: values must be float32, bfloat16 or float16, got {values.dtype}")
    elif values.layout != torch.strided or values.is_nested or values.device.type == "meta":
        raise XgrError(
            f"{name}: values must be a dense tensor with data, got {values.layout} on "
            f"{values.device}"
        )
    return values.detach().to("cpu")
