"""Core request and result types shared by every layer of xgr.

Invariants the engine keeps for every request:

- The prompt's KV (the *shared KV*) is computed once by prefill and stored once per
  request; no decode step copies it per beam.
- Each beam's generated tokens have their own *unshared KV*, at most ``num_levels``
  tokens, reordered in place when beams are reselected.
- Every returned semantic ID is a path of the catalog's prefix trie; every returned
  item belongs to the catalog, and no item appears twice in one result.
"""

from __future__ import annotations

import json
import numbers
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

# The name of an engine's catalog when it is given one, not a mapping of names.
DEFAULT_CATALOG = "default"
# A catalog's name: what a request, a metric label and a CLI option carry.
CATALOG_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class XgrError(ValueError):
    """Bad input to xgr: the message names the argument and what was wrong with it."""


def read_json(path: str | Path, **options: Any) -> Any:
    """A JSON file parsed as UTF-8, with or without the byte-order mark some Windows tools
    write (JSON itself has none); ``options`` go to ``json.loads`` (e.g. ``object_pairs_hook``).

    Raises:
        OSError: the file cannot be read.
        ValueError: not UTF-8 (``UnicodeDecodeError``) or not JSON (``JSONDecodeError``).
    """
    return json.loads(Path(path).read_text(encoding="utf-8-sig"), **options)


class ModelOutputError(XgrError):
    """The model produced no finite log-probability for a prompt (e.g. fp16 overflow)."""


class InputTooLargeError(XgrError):
    """An input over a size limit (the server answers 413)."""


class PromptTooLongError(InputTooLargeError):
    """A prompt longer than the model accepts (the server answers 413)."""


@dataclass(frozen=True)
class Recommendation:
    """One recommended item.

    Attributes:
        item_id: the catalog's item id (a string, as in the index file).
        score: the summed log-probability (natural log, float) of the item's semantic
            ID under the model; items sharing one semantic ID share the score.
        semantic_id: the item's codes, one int per level.
        title: the item's title when the model folder has one (``items.json``), else None.
        level_scores: the log-probability (natural log, float32 values) of each level's
            code given the prompt and the codes before it; summed in level order in
            float32 they give ``score``.
    """

    item_id: str
    score: float
    semantic_id: tuple[int, ...]
    title: str | None = None
    level_scores: tuple[float, ...] = ()


def positive_int(name: str, value: Any) -> int:
    """``value`` as a plain int, if it is an integer >= 1 (Python or numpy, not a bool).

    Raises:
        XgrError: anything else; the message names ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise XgrError(f"{name} must be an integer >= 1, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Prompt:
    """A prompt whose input embeddings are given in places (or everywhere).

    ``Prompt(token_ids=ids, embeds=[(offset, values), ...])``: each span's ``values``
    replace the model's input embeddings at positions offset .. offset + n - 1; the token
    ids there are placeholders (any id of the vocabulary). ``Prompt(embeds=values)``: a
    prompt made only of embeddings. For a T5-family model the embeddings are the encoder's
    input. The engine checks the spans (``Engine.recommend``).

    Attributes:
        token_ids: the prompt's token ids (ints, or an int NumPy array); None for a prompt
            made only of embeddings.
        embeds: a list of (offset, values) spans, ``values`` an (n, hidden_size) float32,
            bfloat16 or float16 array (NumPy or torch); or, with no token ids, one such
            array for the whole prompt.
    """

    token_ids: Any = None
    embeds: Any = ()

    def __len__(self) -> int:
        """Positions of the prompt (its tokens, or its embeddings' rows)."""
        return len(self.token_ids) if self.token_ids is not None else len(self.embeds)


# Widest beam accepted (the beams' KV and score buffers grow linearly with it).
MAX_BEAM_WIDTH = 4096


@dataclass(frozen=True)
class SearchParams:
    """Beam-search parameters of one request, validated once.

    Attributes:
        beam_width: beams kept after every decode step (1 .. MAX_BEAM_WIDTH).
        top_k: candidates each beam contributes per step before the global selection (>= 1);
            at the first level the single root beam contributes max(top_k, beam_width), so
            the search always starts from beam_width beams.
        num_results: semantic IDs returned, best first (1 <= num_results <= beam_width).

    Raises:
        XgrError: on any value out of range.
    """

    beam_width: int = 64
    top_k: int = 64
    num_results: int = 10

    def __post_init__(self) -> None:
        for name in ("beam_width", "top_k", "num_results"):
            # numpy ints become plain ints
            object.__setattr__(self, name, positive_int(name, getattr(self, name)))
        if self.beam_width > MAX_BEAM_WIDTH:
            raise XgrError(f"beam_width must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}")
        if self.num_results > self.beam_width:
            raise XgrError(
                f"num_results ({self.num_results}) must not exceed beam_width ({self.beam_width})"
            )


@dataclass
class RecommendResult:
    """The answer to one prompt.

    Attributes:
        items: recommended items, best first; all items of one semantic ID are adjacent,
            in catalog order.
        semantic_ids: the ``num_results`` best semantic IDs found by beam search with their
            scores, best first; with item rules, only semantic IDs with a passing item.
        level_scores: each of ``semantic_ids``' per-level code log-probabilities
            (``Recommendation.level_scores``), in the same order.
        prompt_tokens: prompt length in tokens.
        prefill_ms: wall time (ms) of the batch's prefill this prompt ran in.
        decode_ms: wall time (ms) of the batch's decode steps.
        catalog_version: the catalog version the search ran on (``Engine.update_catalog``).
        catalog: the name of the catalog searched (``Engine.catalogs``).
        complete: False when the beam_width final beams held fewer than ``num_results``
            semantic IDs with an item passing the request's rules (fewer such semantic IDs
            exist, or a beam narrower than them found fewer): ``items`` then has fewer
            semantic IDs than asked.
    """

    items: list[Recommendation] = field(default_factory=list)
    semantic_ids: list[tuple[tuple[int, ...], float]] = field(default_factory=list)
    level_scores: list[tuple[float, ...]] = field(default_factory=list)
    prompt_tokens: int = 0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    complete: bool = True
    catalog_version: int = 1
    catalog: str = DEFAULT_CATALOG


class PendingResults(Protocol):
    """A launched batch: ``result()`` waits for it and gives one ``RecommendResult`` per
    prompt, in order (or raises the batch's error), from any thread, any number of times."""

    def result(self) -> list[RecommendResult]: ...


class RecommendationEngine(Protocol):
    """The engine as the scheduler and the benchmarks call it; ``xgr.Engine`` is one.

    ``recommend_async`` returns once the batch's device work is queued; up to
    ``max_in_flight`` batches may be in flight at once (each call from its own thread).
    """

    @property
    def max_in_flight(self) -> int:
        """Batches the engine can have in flight at once."""
        ...

    @property
    def num_levels(self) -> int:
        """Codes in a semantic ID (decode steps per search)."""
        ...

    def recommend_async(
        self,
        prompts: Any,
        beam_width: int,
        top_k: int,
        num_results: Any,
        exclude_item_ids: Any,
        allow_item_ids: Any = None,
        item_filter: Any = None,
        catalog: str | None = None,
    ) -> PendingResults:
        """Launch a batch (``xgr.Engine.recommend_async``'s arguments)."""
        ...
