"""xgr: a serving engine for LLM-based generative recommendation."""

from importlib.metadata import PackageNotFoundError, version

from xgr.catalog import ItemCatalog
from xgr.client import Client, ServerError
from xgr.core import Prompt, Recommendation, RecommendResult, SearchParams, XgrError
from xgr.engine import Engine

try:
    __version__ = version("xgr")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "__version__",
    "Client",
    "Engine",
    "ItemCatalog",
    "Prompt",
    "Recommendation",
    "RecommendResult",
    "SearchParams",
    "ServerError",
    "XgrError",
]
