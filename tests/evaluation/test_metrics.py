import math

import pytest

from xgr.core import XgrError
from xgr.evaluation import ndcg_at_k, recall_at_k
from xgr.evaluation.metrics import target_ranks


def test_hand_computed_example():
    ranked = [["a", "b", "c"], ["x", "y", "z"], ["p", "q", "t"], []]
    targets = ["a", "z", "missing", "a"]
    # Ranks: 0, 2, none, none.
    assert target_ranks(ranked, targets, 3) == [0, 2, None, None]
    assert recall_at_k(ranked, targets, 3) == pytest.approx(2 / 4)
    assert ndcg_at_k(ranked, targets, 3) == pytest.approx((1.0 + 1.0 / math.log2(4)) / 4)


def test_cutoff_drops_lower_ranks():
    ranked = [["a", "b", "c"], ["x", "y", "z"]]
    targets = ["a", "z"]
    assert recall_at_k(ranked, targets, 2) == pytest.approx(0.5)
    assert ndcg_at_k(ranked, targets, 2) == pytest.approx(0.5)
    assert recall_at_k(ranked, targets, 1) == pytest.approx(0.5)


def test_rank_one_gets_ndcg_0_63():
    assert ndcg_at_k([["b", "a"]], ["a"], 10) == pytest.approx(1 / math.log2(3))
    assert ndcg_at_k([["b", "a"]], ["a"], 10) == pytest.approx(0.6309, abs=1e-4)


def test_duplicates_count_once():
    # "b" repeated must not push "a" out of the top 2.
    assert target_ranks([["b", "b", "a"]], ["a"], 2) == [1]


def test_bad_input_raises():
    with pytest.raises(XgrError, match="k must be"):
        recall_at_k([["a"]], ["a"], 0)
    with pytest.raises(XgrError, match="2 ranked lists for 1 targets"):
        ndcg_at_k([["a"], ["b"]], ["a"], 1)
    with pytest.raises(XgrError, match="no users"):
        recall_at_k([], [], 5)
