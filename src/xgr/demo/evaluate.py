"""Leave-one-out evaluation of the demo model against a most-popular baseline."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from xgr.core import XgrError
from xgr.demo.movielens import MovieLensData, leave_one_out
from xgr.engine import Engine
from xgr.evaluation.metrics import ndcg_at_k, recall_at_k


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


def evaluate_demo(
    engine: Engine,
    data: MovieLensData,
    k: int = 10,
    beam_width: int = 64,
    max_users: int | None = None,
    batch_size: int = 64,
    progress: bool = True,
) -> dict[str, Any]:
    """Recall@k and NDCG@k of the model and of most-popular on each user's last item.

    For every user, the history is every item before the held-out last one; the prompt is
    ``engine.history_prompt`` of it (the model folder's prompt format), and items of the
    history are excluded from both the model's and the baseline's lists. Popularity is
    counted on the training interactions (all histories of all users, never the held-out
    items).

    Args:
        engine: ``xgr.Engine`` on the demo model folder.
        data: the MovieLens data the folder was built from.
        k: metric cut-off.
        beam_width: beams of the search; ``beam_width`` semantic IDs are requested, so
            enough items survive the history exclusion.
        max_users: evaluate only the first users (None: all).
        batch_size: prompts per ``recommend`` call.
        progress: show a tqdm bar.

    Returns:
        ``{"users", "k", "beam_width", "seconds", "model": {"recall@k", "ndcg@k"},
        "popularity": {...}, "short_lists"}``; ``short_lists`` counts users for whom the model
        returned fewer than ``k`` items.

    Raises:
        XgrError: bad k, beam_width or max_users.
    """
    if beam_width < k:
        raise XgrError(f"beam_width ({beam_width}) must be >= k ({k})")
    if max_users is not None and max_users < 1:
        raise XgrError(f"max_users must be None or >= 1, got {max_users}")
    catalog = engine.catalog
    split = leave_one_out(data)
    count = len(split.users) if max_users is None else min(max_users, len(split.users))
    histories, targets = split.histories[:count], split.targets[:count]
    started = time.perf_counter()
    ranked = rank_items(engine, histories, k, beam_width, batch_size, progress)
    seconds = time.perf_counter() - started
    popular = popularity_ranking(split.histories, catalog.item_ids)
    baseline = [top_k_excluding(popular, set(h), k) for h in histories]
    return {
        "users": count,
        "k": k,
        "beam_width": beam_width,
        "seconds": round(seconds, 1),
        "model": _scores(ranked, targets, k),
        "popularity": _scores(baseline, targets, k),
        "short_lists": sum(len(r) < k for r in ranked),
    }


def rank_items(
    engine: Engine,
    histories: Sequence[Sequence[str]],
    k: int,
    beam_width: int,
    batch_size: int = 64,
    progress: bool = False,
) -> list[list[str]]:
    """Each history's top-k item ids, best first, its own items excluded.

    The prompt is ``engine.history_prompt`` of the history; ``beam_width`` semantic IDs are
    requested (top_k = beam_width), so enough items survive the exclusion.

    Returns:
        one list of at most k item ids per history.
    """
    scored = score_items(engine, histories, beam_width, batch_size, progress)
    return [list(items)[:k] for items in scored]


def score_items(
    engine: Engine,
    histories: Sequence[Sequence[str]],
    beam_width: int,
    batch_size: int = 64,
    progress: bool = False,
) -> list[dict[str, float]]:
    """Each history's recommended items (its own excluded) -> score, best first: every item
    of the ``beam_width`` semantic IDs ``rank_items`` asks for, with their summed
    log-probabilities.
    """
    scored: list[dict[str, float]] = []
    bar = tqdm(total=len(histories), desc="evaluating", unit="user", disable=not progress)
    for first in range(0, len(histories), batch_size):
        batch = histories[first : first + batch_size]
        results = engine.recommend(
            [engine.history_prompt(h) for h in batch],
            beam_width=beam_width,
            top_k=beam_width,
            num_results=beam_width,
            exclude_item_ids=[set(h) for h in batch],
        )
        scored.extend({r.item_id: r.score for r in res.items} for res in results)
        bar.update(len(batch))
    bar.close()
    return scored


def _scores(ranked: list[list[str]], targets: list[str], k: int) -> dict[str, float]:
    return {
        f"recall@{k}": round(recall_at_k(ranked, targets, k), 4),
        f"ndcg@{k}": round(ndcg_at_k(ranked, targets, k), 4),
    }
