"""Top-k ranking metrics for one held-out relevant item per user (leave-one-out).

With a single relevant item, the usual definitions reduce to:

- Recall@k (also called Hit Rate@k / HR@k): the fraction of users whose held-out item is
  among their top ``k`` recommendations (Recall@k = |relevant in top k| / |relevant|,
  averaged over users).
- NDCG@k (Jarvelin & Kekalainen, 2002, "Cumulated gain-based evaluation of IR
  techniques"): DCG@k = sum over ranks r (0-based) of rel_r / log2(r + 2), divided by the
  ideal DCG. With one relevant item the ideal DCG is 1, so a user's NDCG@k is
  ``1 / log2(rank + 2)`` if the item is at 0-based ``rank < k``, else 0; averaged over users.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from xgr.core import XgrError


def target_ranks(
    ranked: Sequence[Sequence[str]], targets: Sequence[str], k: int
) -> list[int | None]:
    """0-based rank of each target within the first ``k`` distinct items, or None.

    Args:
        ranked: per user, recommended item ids, best first (a repeated id counts once, at
            its first position).
        targets: per user, the one relevant item id.
        k: cut-off (>= 1).

    Raises:
        XgrError: k < 1, no users, or ``ranked`` and ``targets`` of different lengths.
    """
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise XgrError(f"k must be an integer >= 1, got {k!r}")
    if len(ranked) != len(targets):
        raise XgrError(f"{len(ranked)} ranked lists for {len(targets)} targets")
    if not targets:
        raise XgrError("no users to evaluate: ranked and targets are empty")
    ranks: list[int | None] = []
    for items, target in zip(ranked, targets, strict=True):
        seen: list[str] = []
        for item in items:
            if item not in seen:
                seen.append(item)
                if len(seen) == k:
                    break
        ranks.append(seen.index(target) if target in seen else None)
    return ranks


def recall_at_k(ranked: Sequence[Sequence[str]], targets: Sequence[str], k: int) -> float:
    """Mean Recall@k (= HR@k) over users with one relevant item each.

    Returns:
        a float in [0, 1]: the fraction of users whose target is in their top ``k``.

    Raises:
        XgrError: as ``target_ranks``.
    """
    ranks = target_ranks(ranked, targets, k)
    return sum(r is not None for r in ranks) / len(ranks)


def ndcg_at_k(ranked: Sequence[Sequence[str]], targets: Sequence[str], k: int) -> float:
    """Mean NDCG@k over users with one relevant item each: ``1 / log2(rank + 2)`` or 0.

    Returns:
        a float in [0, 1].

    Raises:
        XgrError: as ``target_ranks``.
    """
    ranks = target_ranks(ranked, targets, k)
    return sum(1.0 / math.log2(r + 2) for r in ranks if r is not None) / len(ranks)
