"""xgr: a serving engine for LLM-based generative recommendation."""

from xgr.catalog import ItemCatalog
from xgr.client import Client
from xgr.core import Recommendation, RecommendResult, SearchParams, XgrError
from xgr.engine import Engine

__all__ = [
    "Client",
    "Engine",
    "ItemCatalog",
    "Recommendation",
    "RecommendResult",
    "SearchParams",
    "XgrError",
]
