"""Turning a user's history of items into a prompt of token ids.

A model folder may describe its prompt in ``xgr_prompt.json``::

    {"prefix_tokens": ["<bos>"], "suffix_tokens": [], "max_history_items": 50}

The prompt is the prefix, then the semantic-ID tokens of the most recent
``max_history_items`` items (oldest first), then the suffix. Without the file the prompt is
just the items' tokens with no history cap.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xgr.catalog import ItemCatalog, history_entries
from xgr.core import XgrError, read_json

PROMPT_FORMAT_FILE = "xgr_prompt.json"


@dataclass(frozen=True)
class PromptFormat:
    """How a history becomes a prompt.

    Attributes:
        prefix: token ids before the history.
        suffix: token ids after the history.
        max_history_items: most recent items kept (None: all).
    """

    prefix: tuple[int, ...] = ()
    suffix: tuple[int, ...] = ()
    max_history_items: int | None = None

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, vocab: dict[str, int]) -> PromptFormat:
        """Read ``xgr_prompt.json`` (token strings resolved through ``vocab``); default if absent.

        Raises:
            XgrError: unreadable file, or a token the tokenizer does not have.
        """
        path = Path(model_dir) / PROMPT_FORMAT_FILE
        if not path.exists():
            return cls()
        try:
            raw = read_json(path)
        except (OSError, ValueError) as exc:
            raise XgrError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise XgrError(f"{path} must be a JSON object, got {type(raw).__name__}")

        def ids(key: str) -> tuple[int, ...]:
            tokens = raw.get(key, [])
            if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                raise XgrError(f"{path}: {key} must be a list of token strings, got {tokens!r}")
            missing = [t for t in tokens if t not in vocab]
            if missing:
                raise XgrError(f"{path}: {key} has tokens the tokenizer lacks: {missing}")
            return tuple(vocab[t] for t in tokens)

        limit = raw.get("max_history_items")
        if limit is not None and (type(limit) is not int or limit < 1):
            raise XgrError(f"{path}: max_history_items must be an integer >= 1 or null")
        return cls(ids("prefix_tokens"), ids("suffix_tokens"), limit)

    def build(
        self,
        history: Sequence[Any],
        catalog: ItemCatalog,
        sid_token_ids: np.ndarray,
        max_tokens: int | None = None,
    ) -> list[int]:
        """Token ids of the prompt for ``history`` (item ids, oldest first).

        Args:
            history: item ids known to the catalog.
            catalog: the served catalog.
            sid_token_ids: (num_levels, codebook_size) int64 code -> token id map.
            max_tokens: when given, drop the oldest items until the prompt fits.

        Raises:
            XgrError: empty history, unknown item ids (all of them named), a history that is
                not a list (``history_entries``), or a prompt that cannot fit ``max_tokens``
                even with a single item.
        """
        items = [str(i) for i in history_entries(history)]
        if not items:
            raise XgrError("empty history: at least one item is needed")
        unknown = [i for i in items if i not in catalog.item_index]
        if unknown:
            raise XgrError(f"unknown item ids: {unknown[:20]}")
        if self.max_history_items is not None:
            items = items[-self.max_history_items :]
        per_item = catalog.num_levels
        fixed = len(self.prefix) + len(self.suffix)
        if max_tokens is not None:
            room = (max_tokens - fixed) // per_item
            if room < 1:
                raise XgrError(f"a prompt of one item needs {fixed + per_item} tokens")
            items = items[-room:]
        rows = np.array([catalog.item_index[i] for i in items])
        codes = catalog.codes[rows]  # [items, levels]
        tokens = sid_token_ids[np.arange(per_item)[None, :], codes].reshape(-1)
        return [*self.prefix, *tokens.tolist(), *self.suffix]

    def num_tokens(self, num_items: int, num_levels: int) -> int:
        """Prompt length (tokens) for a history of ``num_items`` items."""
        if self.max_history_items is not None:
            num_items = min(num_items, self.max_history_items)
        return len(self.prefix) + num_items * num_levels + len(self.suffix)


def integer_tokens(prompt: Any) -> np.ndarray:
    """A sequence (list, tuple, range, 1-D array or tensor) of integer token ids as a new
    (tokens,) integer array.

    Raises:
        XgrError: anything else (floats, bools, strings, nested lists, other shapes).
    """
    refusal = "a prompt is a string or a list of integer token ids"
    if isinstance(prompt, np.ma.MaskedArray):  # its masked entries would escape the checks
        raise XgrError(f"{refusal}, not a masked array")
    if isinstance(prompt, bytes | bytearray | memoryview):
        raise XgrError(refusal)
    try:
        if isinstance(prompt, np.ndarray) and prompt.dtype == object:
            prompt = prompt.tolist()  # Python objects: checked one by one as a list is
        elif not isinstance(prompt, np.ndarray | list | tuple) and hasattr(prompt, "tolist"):
            prompt = prompt.tolist()  # torch tensors, array.array
        elif isinstance(prompt, Sequence) and not isinstance(prompt, np.ndarray | list | tuple):
            prompt = list(prompt)  # range and other sequences (str is refused below)
    except Exception as exc:  # a tensor that cannot leave its device or layout, ...
        raise XgrError(f"{refusal}: {exc}") from exc
    if isinstance(prompt, np.ndarray):
        if prompt.ndim != 1 or (prompt.size and prompt.dtype.kind not in "iu"):
            raise XgrError(refusal)
        return prompt.copy()
    if not isinstance(prompt, list | tuple):
        raise XgrError(refusal)
    try:
        tokens = np.array(prompt)
    except Exception as exc:  # ragged nesting, beyond any integer type, unconvertible items
        raise XgrError(refusal) from exc
    if not tokens.size:
        return tokens.astype(np.int64)
    if tokens.ndim == 1 and tokens.dtype.kind in "fO":
        # NumPy makes float64 of uint64 mixed with signed ints: such lists are checked item
        # by item (an error path for every other list that lands here).
        tokens = _integer_items(prompt, refusal)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise XgrError(refusal)
    # NumPy reads True as 1 among ints; a bool (Python's, NumPy's, a 0-d bool array) can only
    # have become a 0 or a 1.
    for i in np.flatnonzero(tokens <= 1).tolist():
        if np.asarray(prompt[i]).dtype.kind == "b":
            raise XgrError(refusal)
    return tokens


def _integer_items(items: list | tuple, refusal: str) -> np.ndarray:
    """Items that are each an integer (Python's or NumPy's, or a 0-d integer array or
    tensor) as an int64 array.

    Raises:
        XgrError: an item that is not, or a value beyond int64.
    """
    values = []
    for item in items:
        if isinstance(item, int) and not isinstance(item, bool):
            values.append(item)
            continue
        try:
            value = np.asarray(item)
        except Exception as exc:  # a tensor that cannot become an array
            raise XgrError(refusal) from exc
        if value.ndim != 0 or value.dtype.kind not in "iu":
            raise XgrError(refusal)
        values.append(int(value))
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError as exc:
        raise XgrError(refusal) from exc


def refuse_unencodable_text(prompt: str) -> None:
    """Raise XgrError when ``prompt`` holds a lone surrogate (JSON's ``"\\ud800"`` escape
    decodes to one): no UTF-8 text has it, and the tokenizer refuses it with a TypeError."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise XgrError(
            f"invalid text: {prompt[exc.start]!r} at character {exc.start} of the prompt is a "
            "lone surrogate, which UTF-8 cannot encode"
        ) from None


def refuse_unknown_pieces(tokenizer: Any, prompt: str, encoding: Any) -> None:
    """Raise XgrError naming the first piece of ``prompt`` that the tokenizer could only map
    to its unknown token (a typo such as ``<a_14 >`` would otherwise run as ``<unk>`` and
    return results for a prompt nobody wrote). The unknown token written out is accepted.
    Tokenizers without an unknown token (byte-level BPE) map every piece and pass."""
    unk = getattr(tokenizer.model, "unk_token", None)
    unk_id = tokenizer.token_to_id(unk) if unk else None
    if unk_id is None:
        return
    for token_id, (start, end) in zip(encoding.ids, encoding.offsets, strict=True):
        if token_id == unk_id and prompt[start:end] != unk:
            raise XgrError(
                f"unknown token {prompt[start:end]!r} at character {start} of the prompt: "
                "not in the model's vocabulary"
            )


def each_prompt(prompts: Sequence[Any], convert: Callable[[Any], Any]) -> list[Any]:
    """``convert`` of each prompt, in order.

    Raises:
        XgrError: ``convert``'s, of the same type; for one prompt of several its message
            says which ("prompt 2: ...").
    """
    out = []
    for i, prompt in enumerate(prompts):
        try:
            out.append(convert(prompt))
        except XgrError as exc:
            if len(prompts) == 1:
                raise
            raise type(exc)(f"prompt {i}: {exc}") from exc
    return out
