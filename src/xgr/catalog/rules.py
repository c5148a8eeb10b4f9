"""Per-request item rules (allow-list, exclusions, attribute filter) and the masks of the
catalog's trie that apply them inside the search.

An item passes its request's rules when it is in the allow-list (if one is given), not
excluded, and passes the filter (if one is given). A semantic ID is a candidate when at least
one of its items passes, a prefix when a semantic ID below it is: the masks are built on the
device from the item rows, carried from the leaves to the root through each trie level's
``child_parent`` table, so the search over them equals the search of a catalog restricted to
the passing items.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from xgr.catalog.attributes import ItemFilter, compile_filter
from xgr.catalog.catalog import ItemCatalog
from xgr.catalog.trie import PrefixTrie
from xgr.core import XgrError


@dataclass(frozen=True)
class ItemRules:
    """One request's rules.

    Attributes:
        allow: sorted catalog rows of the only items that may be returned; None: every item.
        exclude: sorted catalog rows of items never returned; None: none.
        filter: the compiled attribute filter; None: no filter.
    """

    allow: np.ndarray | None = None
    exclude: np.ndarray | None = None
    filter: ItemFilter | None = None

    @property
    def active(self) -> bool:
        """Whether the rules may leave out an item."""
        excludes = self.exclude is not None and len(self.exclude) > 0
        return self.allow is not None or self.filter is not None or excludes

    def keep(self, catalog: ItemCatalog, rows: np.ndarray) -> np.ndarray:
        """(len(rows),) bool: which of these catalog rows pass (on the host)."""
        keep = np.ones(len(rows), dtype=bool)
        if self.allow is not None:
            keep &= _among(rows, self.allow)
        if self.exclude is not None and len(self.exclude):
            keep &= ~_among(rows, self.exclude)
        if self.filter is not None:
            keep &= self.filter.passes(catalog.attributes, rows)
        return keep

    def any_passes(self, catalog: ItemCatalog) -> bool:
        """Whether some item of the catalog passes (on the host, over every item: for the
        rare request with no result, to tell a broken model from rules that leave nothing)."""
        if not self.active:
            return len(catalog) > 0
        return bool(self.keep(catalog, np.arange(len(catalog), dtype=np.int64)).any())


NO_RULES = ItemRules()


def _among(rows: np.ndarray, sorted_rows: np.ndarray) -> np.ndarray:
    """Which of ``rows`` are in the sorted ``sorted_rows`` (a binary search each)."""
    if not len(sorted_rows):
        return np.zeros(len(rows), dtype=bool)
    place = np.searchsorted(sorted_rows, rows).clip(max=len(sorted_rows) - 1)
    return sorted_rows[place] == rows


def request_rules(
    catalog: ItemCatalog,
    num_prompts: int,
    allow_item_ids: Any = None,
    exclude_item_ids: Any = None,
    item_filter: Any = None,
) -> list[ItemRules]:
    """Each prompt's ``ItemRules`` from ``Engine.recommend``'s arguments: each None, or one
    entry per prompt (None in an entry: no such rule for that prompt). Item ids outside the
    catalog are ignored (an allow-list of only such ids allows nothing).

    Raises:
        XgrError: not one entry per prompt, an entry that is not a list of item ids (strings
            or ints), or a filter ``compile_filter`` refuses.
    """
    allows = _per_prompt("allow_item_ids", allow_item_ids, num_prompts)
    excludes = _per_prompt("exclude_item_ids", exclude_item_ids, num_prompts)
    filters = _per_prompt("item_filter", item_filter, num_prompts, lists=False)
    out = []
    for i in range(num_prompts):
        allow = None
        if allows[i] is not None:
            allow = _rows(catalog, item_id_set(allows[i], i, "allow_item_ids"))
        exclude = None
        if excludes[i] is not None:
            exclude = _rows(catalog, item_id_set(excludes[i], i, "exclude_item_ids"))
        spec = filters[i]
        compiled = None if spec is None else compile_filter(spec, catalog.attributes)
        if compiled is not None and not compiled.conditions:
            compiled = None  # {}: no condition, every item passes
        out.append(ItemRules(allow, exclude, compiled))
    return out


def _per_prompt(name: str, value: Any, num_prompts: int, lists: bool = True) -> list[Any]:
    if value is None:
        return [None] * num_prompts
    if (
        isinstance(value, str | bytes | Mapping)
        or not isinstance(value, list | tuple | np.ndarray)
        or (isinstance(value, np.ndarray) and value.ndim == 0)
    ):
        what = "a list of item ids" if lists else "a filter object"
        raise XgrError(
            f"{name} must be a list with one entry ({what}, or None) per prompt, got "
            f"{type(value).__name__}"
        )
    if len(value) != num_prompts:
        raise XgrError(f"{name} needs one entry per prompt")
    return list(value)


def item_id_set(ids: Any, index: int, name: str = "exclude_item_ids") -> list[str]:
    """One prompt's entry of a list of item ids, as a list of item-id strings (repeats kept).

    Raises:
        XgrError: a string (one id must still be in a list) or anything not iterable, or an
            entry that is not a string or an int.
    """
    if isinstance(ids, str | bytes | Mapping) or not isinstance(ids, Iterable):
        raise XgrError(f"{name}[{index}] must be a list of item ids, got {type(ids).__name__}")
    ids = list(ids)
    if all(isinstance(x, str) for x in ids):
        return ids
    # Ints are read as their digits; a float such as 181.0 would be "181.0" and match nothing.
    bad = [x for x in ids if isinstance(x, bool) or not isinstance(x, str | int | np.integer)]
    if bad:
        raise XgrError(f"{name}[{index}] holds {bad[0]!r}: item ids are strings or ints")
    return [str(x) for x in ids]


def _rows(catalog: ItemCatalog, ids: list[str]) -> np.ndarray:
    rows = catalog.rows_of(ids)
    return np.unique(rows[rows >= 0])  # sorted, each once


class CatalogMasks:
    """Builds the per-request masks of a catalog's trie on one device.

    Args:
        catalog: the catalog; its ``sid_of_item`` is copied to the trie's device at the
            first masks (an engine whose requests carry no rules never pays for it).
        trie: the catalog's trie on that device.
    """

    def __init__(self, catalog: ItemCatalog, trie: PrefixTrie) -> None:
        self.catalog = catalog
        self.trie = trie
        self.device = trie.device

    @functools.cached_property
    def sid_of_item(self) -> torch.Tensor:
        """(num_items,) int64 semantic-ID row of each item, on the device."""
        return torch.from_numpy(self.catalog.sid_of_item).to(self.device)

    def item_mask(self, rules: ItemRules) -> torch.Tensor:
        """(num_items,) bool on the device: the items passing ``rules``."""
        num_items, device = len(self.catalog), self.device
        # index_fill_, not index assignment: on CUDA the assignment (index_put_) waits for
        # the stream, which the masks are built behind (the prefill).
        if rules.allow is not None:
            passed = torch.zeros(num_items, dtype=torch.bool, device=device)
            passed.index_fill_(0, self._rows_on_device(rules.allow), True)
        else:
            passed = torch.ones(num_items, dtype=torch.bool, device=device)
        if rules.exclude is not None and len(rules.exclude):
            passed.index_fill_(0, self._rows_on_device(rules.exclude), False)
        if rules.filter is not None:
            passed &= rules.filter.mask(self.catalog.attributes, device)
        return passed

    def _rows_on_device(self, rows: np.ndarray) -> torch.Tensor:
        """Catalog rows on the device; on CUDA from pinned memory, queued without waiting (a
        copy from pageable memory would wait for the stream's earlier work, the prefill)."""
        host = torch.from_numpy(rows)
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)

    def masks(self, rules: list[ItemRules]) -> tuple[torch.Tensor, ...] | None:
        """Each level's allowed children for a batch: masks[l] is (R, nodes at depth l + 1)
        bool, True where some item below the node passes the request's rules (every node
        for a request without rules); None when no request has rules."""
        if not any(r.active for r in rules):
            return None
        levels = self.trie.levels
        num_sids = levels[-1].num_children
        items = torch.stack([self.item_mask(r) for r in rules])  # (R, num_items)
        leaves = torch.zeros(len(rules), num_sids, dtype=torch.int32, device=self.device)
        leaves.index_add_(1, self.sid_of_item, items.to(torch.int32))
        masks = [leaves > 0]
        for level in reversed(levels[1:]):  # depth d + 1 -> d: a parent passes via a child
            parents = torch.zeros(len(rules), level.num_parents, dtype=torch.int32,
                                  device=self.device)  # fmt: skip
            parents.index_add_(1, level.child_parent, masks[0].to(torch.int32))
            masks.insert(0, parents > 0)
        return tuple(masks)
