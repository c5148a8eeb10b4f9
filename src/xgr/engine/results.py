"""A launched batch's results: waiting for the device, then the items of each prompt's
best beams on the host; the checks of the search arguments."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from xgr.catalog import ItemCatalog
from xgr.catalog.rules import NO_RULES, ItemRules
from xgr.core import (
    DEFAULT_CATALOG,
    ModelOutputError,
    Recommendation,
    RecommendResult,
    SearchParams,
    XgrError,
)
from xgr.engine.generate import PendingGeneration
from xgr.engine.lanes import LaneHold


class PendingRecommendation:
    """A batch launched by ``Engine.recommend_async``: ``result()`` waits for it.

    Not made directly. ``result()`` may be called from another thread than the launch, and
    more than once, from several threads (the first call's outcome is kept).
    """

    def __init__(
        self,
        pending: PendingGeneration | None,
        hold: LaneHold | None,
        tokenized: list[np.ndarray],
        params: list[SearchParams],
        rules: list[ItemRules],
        catalog: ItemCatalog,
        titles: dict[str, str],
        dtype: torch.dtype,
        catalog_version: int = 1,
        catalog_name: str = DEFAULT_CATALOG,
    ) -> None:
        """``pending``: the launched batch (None: no prompts); ``hold``: its lane, released
        once the device is done (None: nothing held); ``dtype``: the model's, named in a
        broken model's error; ``catalog_version`` and ``catalog_name``: the searched
        catalog's, copied into each result; the rest as ``build_result`` takes them, one entry per
        prompt."""
        self._pending, self._hold, self._tokenized = pending, hold, tokenized
        self._params, self._rules = params, rules
        self._catalog, self._titles, self._dtype = catalog, titles, dtype
        self._catalog_version, self._catalog_name = catalog_version, catalog_name
        self._results: list[RecommendResult] | None = [] if pending is None else None
        self._error: BaseException | None = None
        self._collecting = threading.Lock()  # one collect, whichever threads ask

    def result(self) -> list[RecommendResult]:
        """One ``RecommendResult`` per prompt, in order.

        Raises:
            ModelOutputError: the model gave no finite log-probability for some prompt.
        """
        with self._collecting:
            if self._results is None and self._error is None:
                try:
                    self._results = self._collect()
                except BaseException as exc:
                    self._error = exc
        if self._error is not None:
            raise self._error
        return self._results

    def _collect(self) -> list[RecommendResult]:
        try:
            out = self._pending.wait()
        finally:  # the lane is free once the device is done with the batch
            if self._hold is not None:
                self._hold.release()
        sid_index, scores = out.sid_index.numpy(), out.scores.numpy()
        level_scores = out.level_scores.numpy()
        # Every live beam has a valid continuation, so no finite score means NaN or -inf
        # log-probabilities everywhere: a broken model or an overflowing dtype. A request
        # whose rules leave no item has no finite score either: it gets no items.
        broken = [
            i
            for i in range(len(self._tokenized))
            if not np.isfinite(scores[i, 0]) and self._rules[i].any_passes(self._catalog)
        ]
        if broken:
            dtype = self._dtype
            hint = (
                "check the weights for NaN or infinite values"
                if dtype == torch.float32
                else "try float32 or bfloat16"  # fp16 overflows where they do not
            )
            raise ModelOutputError(
                f"the model gave no finite log-probability for prompts {broken[:10]} "
                f"(dtype {dtype}); {hint}"
            )
        results = []
        for i, tokens in enumerate(self._tokenized):
            result = build_result(
                self._catalog,
                self._titles,
                sid_index[i],
                scores[i],
                self._params[i].num_results,
                self._rules[i],
                level_scores[i],
            )
            result.prompt_tokens = len(tokens)
            result.catalog_version = self._catalog_version
            result.catalog = self._catalog_name
            result.prefill_ms, result.decode_ms = out.prefill_ms, out.decode_ms
            results.append(result)
        return results


def build_result(
    catalog: ItemCatalog,
    titles: dict[str, str],
    sid_index: np.ndarray,
    scores: np.ndarray,
    num_results: int,
    rules: ItemRules = NO_RULES,
    level_scores: np.ndarray | None = None,
) -> RecommendResult:
    """One prompt's ``RecommendResult`` from its final beams: the first ``num_results``
    semantic IDs, and the items of the first ``num_results`` that have items passing
    ``rules`` (collisions: all of a semantic ID's passing items come back, catalog order).

    Args:
        catalog, titles: the engine's catalog and its item id -> title map.
        sid_index: (B,) int64 ``ItemCatalog.semantic_ids`` row of each beam, best first.
        scores: (B,) float32 summed log-probabilities; -inf where no valid path was left.
        num_results: semantic IDs wanted.
        rules: the prompt's item rules (the search already kept to semantic IDs with a
            passing item; this keeps only those items).
        level_scores: (B, L) float32 per-level code log-probabilities of each beam; None
            leaves them empty.
    """
    result = RecommendResult()
    taken = 0
    active = rules.active
    passing: dict[int, list[str]] = {}  # beam -> its passing items, found a block at a time
    for beam, (sid, score) in enumerate(_leading_beams(sid_index, scores, num_results)):
        if score == float("-inf") or (
            taken == num_results and len(result.semantic_ids) == num_results
        ):
            break  # the rest of the beams (hundreds) would cost host time for nothing
        codes = tuple(catalog.semantic_ids[sid].tolist())
        levels = () if level_scores is None else tuple(level_scores[beam].tolist())
        if len(result.semantic_ids) < num_results:
            result.semantic_ids.append((codes, score))
            result.level_scores.append(levels)
        if taken == num_results:
            continue
        if active:
            if beam not in passing:
                passing.update(_passing_items(catalog, rules, sid_index, beam, 2 * num_results + 8))
            items = passing[beam]
        else:
            items = catalog.items_of_semantic_id(sid)
        result.items.extend(Recommendation(i, score, codes, titles.get(i), levels) for i in items)
        taken += bool(items)
    result.complete = taken == num_results
    return result


def _passing_items(
    catalog: ItemCatalog, rules: ItemRules, sid_index: np.ndarray, start: int, count: int
) -> dict[int, list[str]]:
    """The items passing ``rules`` of beams ``start .. start + count - 1``, checked in one
    call: a check per semantic ID cost host time per returned ID."""
    sids = sid_index[start : start + count]
    rows, counts = catalog.item_rows_of_semantic_ids(sids)
    kept = rules.keep(catalog, rows)
    ids = catalog.item_ids
    out, offset = {}, 0
    for i, n in enumerate(counts.tolist()):
        block = rows[offset : offset + n][kept[offset : offset + n]]
        out[start + i] = [ids[r] for r in block.tolist()]
        offset += n
    return out


def _leading_beams(sid_index: np.ndarray, scores: np.ndarray, num_results: int):
    """(semantic-ID row, score) of the beams best first, as Python ints and floats,
    converted in growing blocks: a result usually needs the first ``num_results`` of
    hundreds of beams (exclusions and collisions may need more)."""
    start, size = 0, 2 * num_results + 8
    while start < len(sid_index):
        stop = start + size
        yield from zip(sid_index[start:stop].tolist(), scores[start:stop].tolist(), strict=True)
        start, size = stop, 2 * size


def search_params(
    num_prompts: int, beam_width: int, top_k: int, num_results: Any
) -> tuple[SearchParams, list[SearchParams]]:
    """The batch's search parameters and each prompt's (``Engine.recommend``'s arguments).

    Args:
        num_results: one int for every prompt, or one per prompt (a sequence or a NumPy
            array; a 0-d array is one value).

    Raises:
        XgrError: invalid values (``SearchParams``), or not one num_results per prompt.
    """
    if isinstance(num_results, np.ndarray):
        num_results = num_results.tolist()
    if not isinstance(num_results, Sequence):
        num_results = [num_results] * num_prompts
    if len(num_results) != num_prompts:
        raise XgrError("num_results needs one entry per prompt")
    search = SearchParams(beam_width, top_k, 1)  # validated even for no prompts
    return search, [SearchParams(search.beam_width, search.top_k, n) for n in num_results]
