"""Offline evaluation of recommendations."""

from xgr.evaluation.metrics import ndcg_at_k, recall_at_k

__all__ = ["ndcg_at_k", "recall_at_k"]
