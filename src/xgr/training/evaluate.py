"""Offline evaluation: Recall@K and NDCG@K of a served model on held-out cases, beside a
most-popular baseline.

Each case's prompt is ``engine.history_prompt`` of its history (the model folder's prompt
format, so the most recent ``max_history_items``), and the full catalog is ranked by the
constrained beam search: the ``beam_width`` best semantic IDs, each with all its items.

Policies, the same for the model and the baseline:

- History: the case's history items are excluded from its list by default (a user is not
  recommended what they already have); ``exclude_history=False`` keeps them.
- Ties: items sharing a semantic ID share its score and are listed in catalog order (the
  index file's order); the baseline's equally popular items are listed in catalog order too.
  A catalog built with a collision level has no shared semantic IDs.
- Unknown items: history items the catalog lacks are dropped from the prompt; a case left
  with no history is skipped (counted in ``skipped``); a target the catalog lacks is a miss
  (counted in ``targets_outside_catalog``).
- Popularity: interaction counts over the training sequences given (never the held-out
  targets).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from xgr.core import XgrError
from xgr.engine import Engine
from xgr.evaluation.metrics import ndcg_at_k, recall_at_k
from xgr.training.interactions import HeldOut

TIE_POLICY = (
    "items sharing a semantic ID share its score and are listed in catalog order; the "
    "baseline's equally popular items in catalog order"
)


def popularity_ranking(histories: Sequence[Sequence[str]], item_ids: Sequence[str]) -> list[str]:
    """Items by descending interaction count in ``histories``; ties in ``item_ids`` order.

    Returns:
        every id of ``item_ids`` (unseen items last), most popular first.
    """
    counts = Counter(item for seq in histories for item in seq)
    order = sorted(range(len(item_ids)), key=lambda i: -counts.get(item_ids[i], 0))
    return [item_ids[i] for i in order]


def top_k_excluding(ranking: Sequence[str], excluded: set[str], k: int) -> list[str]:
    """The first ``k`` items of ``ranking`` that are not in ``excluded``."""
    out = []
    for item in ranking:
        if item not in excluded:
            out.append(item)
            if len(out) == k:
                break
    return out


def evaluate_cases(
    engine: Engine,
    cases: HeldOut,
    ks: Sequence[int],
    beam_width: int,
    popularity: Sequence[Sequence[str]],
    exclude_history: bool = True,
    batch_size: int = 64,
    progress: bool = True,
    catalog: str | None = None,
) -> dict[str, Any]:
    """Recall@K and NDCG@K of the model and of most-popular on held-out cases (the
    policies of the module docstring).

    Args:
        engine: the model served.
        cases: histories and their next items.
        ks: the cut-offs (each >= 1 and <= beam_width).
        beam_width: beams of the search; as many semantic IDs are asked for.
        popularity: the training sequences the baseline counts.
        exclude_history: drop each history's items from its lists.
        batch_size: prompts per ``recommend`` call.
        progress: show a tqdm bar.
        catalog: the engine's catalog to rank (None: its default).

    Returns:
        ``{"cases", "skipped", "targets_outside_catalog", "ks", "beam_width",
        "exclude_history", "ties", "seconds", "model": {"recall@K": ..., "ndcg@K": ...},
        "popularity": {...}, "short_lists"}``; ``short_lists`` counts cases for which the
        model returned fewer than max(ks) items. Figures are rounded to 4 decimals.

    Raises:
        XgrError: no ks, a k out of range, or no case with a history in the catalog.
    """
    ks = sorted(set(ks))
    if not ks or ks[0] < 1 or ks[-1] > beam_width:
        raise XgrError(f"every k must be in [1, beam_width={beam_width}], got {list(ks)}")
    known = engine.served_catalog(catalog).current.catalog
    histories, targets, skipped = [], [], 0
    for history, target in zip(cases.histories, cases.targets, strict=True):
        kept = [item for item in history if item in known.item_index]
        if not kept:
            skipped += 1
            continue
        histories.append(kept)
        targets.append(target)
    if not histories:
        raise XgrError("no held-out case has a history the catalog knows")
    started = time.perf_counter()
    ranked = rank_items(
        engine, histories, ks[-1], beam_width, batch_size, progress, exclude_history, catalog
    )
    seconds = time.perf_counter() - started
    popular = popularity_ranking(popularity, known.item_ids)
    baseline = [
        top_k_excluding(popular, set(h) if exclude_history else set(), ks[-1]) for h in histories
    ]
    return {
        "cases": len(histories),
        "skipped": skipped,
        "targets_outside_catalog": sum(t not in known.item_index for t in targets),
        "ks": ks,
        "beam_width": beam_width,
        "exclude_history": exclude_history,
        "ties": TIE_POLICY,
        "seconds": round(seconds, 1),
        "model": ranking_scores(ranked, targets, ks),
        "popularity": ranking_scores(baseline, targets, ks),
        "short_lists": sum(len(r) < ks[-1] for r in ranked),
    }


def ranking_scores(
    ranked: list[list[str]], targets: Sequence[str], ks: Sequence[int]
) -> dict[str, float]:
    """``{"recall@K": ..., "ndcg@K": ...}`` for each K, rounded to 4 decimals."""
    scores = {}
    for k in ks:
        scores[f"recall@{k}"] = round(recall_at_k(ranked, list(targets), k), 4)
        scores[f"ndcg@{k}"] = round(ndcg_at_k(ranked, list(targets), k), 4)
    return scores


def rank_items(
    engine: Engine,
    histories: Sequence[Sequence[str]],
    k: int,
    beam_width: int,
    batch_size: int = 64,
    progress: bool = False,
    exclude_history: bool = True,
    catalog: str | None = None,
) -> list[list[str]]:
    """Each history's top-k item ids, best first (its own items excluded by default).

    The prompt is ``engine.history_prompt`` of the history; ``beam_width`` semantic IDs are
    requested (top_k = beam_width), so enough items survive the exclusion.

    Returns:
        one list of at most k item ids per history.
    """
    scored = score_items(
        engine, histories, beam_width, batch_size, progress, exclude_history, catalog
    )
    return [list(items)[:k] for items in scored]


def score_items(
    engine: Engine,
    histories: Sequence[Sequence[str]],
    beam_width: int,
    batch_size: int = 64,
    progress: bool = False,
    exclude_history: bool = True,
    catalog: str | None = None,
) -> list[dict[str, float]]:
    """Each history's recommended items -> score, best first: every item of the
    ``beam_width`` semantic IDs ``rank_items`` asks for, with their summed
    log-probabilities (a history's own items excluded by default).
    """
    scored: list[dict[str, float]] = []
    bar = tqdm(total=len(histories), desc="evaluating", unit="case", disable=not progress)
    for first in range(0, len(histories), batch_size):
        batch = histories[first : first + batch_size]
        results = engine.recommend(
            [engine.history_prompt(h, catalog=catalog) for h in batch],
            beam_width=beam_width,
            top_k=beam_width,
            num_results=beam_width,
            exclude_item_ids=[set(h) for h in batch] if exclude_history else None,
            catalog=catalog,
        )
        scored.extend({r.item_id: r.score for r in res.items} for res in results)
        bar.update(len(batch))
    bar.close()
    return scored
