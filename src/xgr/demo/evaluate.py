"""Leave-one-out evaluation of the demo model against a most-popular baseline."""

from __future__ import annotations

from typing import Any

from xgr.core import XgrError
from xgr.demo.movielens import MovieLensData, leave_one_out
from xgr.engine import Engine
from xgr.training.evaluate import evaluate_cases
from xgr.training.interactions import HeldOut


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
    report = evaluate_cases(
        engine, demo_cases(data, max_users), [k], beam_width, leave_one_out(data).histories,
        batch_size=batch_size, progress=progress,
    )  # fmt: skip
    keep = ("beam_width", "seconds", "model", "popularity", "short_lists")
    return {"users": report["cases"], "k": k, **{key: report[key] for key in keep}}


def demo_cases(data: MovieLensData, max_users: int | None = None) -> HeldOut:
    """The demo's test cases: each user's last item, after every item before it.

    Raises:
        XgrError: max_users below 1.
    """
    if max_users is not None and max_users < 1:
        raise XgrError(f"max_users must be None or >= 1, got {max_users}")
    split = leave_one_out(data)
    cases = HeldOut(tuple(split.users), tuple(map(tuple, split.histories)), tuple(split.targets))
    return cases.head(max_users)
