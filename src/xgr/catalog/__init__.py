"""Catalogs of items and semantic IDs, and the valid-path trie used to constrain beam search."""

from xgr.catalog.catalog import CATALOG_METADATA_FILE, ItemCatalog
from xgr.catalog.history import ResolvedHistory, TitleIndex, history_entries, resolve_history
from xgr.catalog.trie import PrefixTrie, TrieLevel, build_prefix_trie

__all__ = [
    "CATALOG_METADATA_FILE",
    "ItemCatalog",
    "PrefixTrie",
    "ResolvedHistory",
    "TitleIndex",
    "TrieLevel",
    "build_prefix_trie",
    "history_entries",
    "resolve_history",
]
