"""A catalog's next version from an update: items added with their codes, items removed,
attributes set, or the whole catalog replaced (``apply_update``). Host work only; the engine
builds the version's device tables (``Engine.update_catalog``)."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from xgr.catalog.attributes import Column, ItemAttributes, encode_value
from xgr.catalog.catalog import ItemCatalog
from xgr.core import XgrError


@dataclass(frozen=True)
class CatalogUpdate:
    """One update of a catalog (``Engine.update_catalog``'s arguments).

    Attributes:
        add: item id -> its semantic ID (code tokens such as ``["<a_1>", "<b_2>"]``, or one
            string of them, or ints), for items not in the catalog.
        remove: ids of items in the catalog.
        set_attributes: item id -> {attribute: value or None (no value)}, for attributes the
            catalog has; applied after ``add`` and ``remove``.
        replace: a whole new catalog (its items keep the attributes they had where the new
            one has none).
    """

    add: Mapping[str, Any] | None = None
    remove: Sequence[str] | None = None
    set_attributes: Mapping[str, Mapping[str, Any]] | None = None
    replace: ItemCatalog | None = None


def apply_update(catalog: ItemCatalog, update: CatalogUpdate) -> ItemCatalog:
    """The catalog after ``update``. Kept items keep their rows, added ones take the rows of
    removed ones and then follow (``ItemCatalog.changed``); a replacement brings its order.

    Raises:
        XgrError: naming what is wrong (nothing changes): an empty update; ``replace``
            not an ``ItemCatalog``, or with other changes; adding an item the catalog has,
            or with codes of other levels or outside the codebook; removing an item it
            lacks; setting an attribute it lacks, on an item it lacks, or of the wrong type.
    """
    if not (update.add or update.remove or update.set_attributes or update.replace is not None):
        raise XgrError("an update needs items to add or remove, attributes to set, or a catalog")
    if update.replace is not None:
        if not isinstance(update.replace, ItemCatalog):
            raise XgrError(
                f"replace takes an ItemCatalog (ItemCatalog.from_index_dict reads an index), "
                f"got {type(update.replace).__name__}"
            )
        if update.add or update.remove:
            raise XgrError("replace takes the whole catalog: no add or remove beside it")
        # A copy: the caller's catalog (or a served version given back) is not changed.
        new = copy.copy(update.replace)
        if new.attributes is None and catalog.attributes is not None:
            new.attributes = _carried(catalog, catalog.rows_of(new.item_ids))
    else:
        new = _added_and_removed(catalog, update.add or {}, update.remove or ())
    if update.set_attributes:
        new.attributes = _with_values(new, update.set_attributes)
    return new


def _added_and_removed(catalog: ItemCatalog, add: Mapping[str, Any], remove) -> ItemCatalog:
    if isinstance(remove, str) or not isinstance(remove, Sequence):
        raise XgrError("remove must be a list of item ids")
    remove = [str(i) for i in remove]
    if len(set(remove)) != len(remove):
        twice = sorted(i for i, n in Counter(remove).items() if n > 1)
        raise XgrError(f"items listed twice in remove: {_names(twice)}")
    missing = [i for i in remove if i not in catalog.item_index]
    if missing:
        raise XgrError(f"cannot remove items the catalog lacks: {_names(missing)}")
    if not isinstance(add, Mapping):
        raise XgrError("add must be an object of item id -> semantic ID")
    given = len(add)
    add = {str(k): v for k, v in add.items()}
    if len(add) != given:
        raise XgrError("add names an item twice (ids that are the same as strings)")
    gone = set(remove)
    present = [i for i in add if i in catalog.item_index and i not in gone]
    if present:
        raise XgrError(
            f"cannot add items the catalog has (to give one other codes, remove and add it in "
            f"one update, where the model's training record allows the move): "
            f"{_names(present)}"
        )
    added = _codes_of(catalog, add)
    new, source = catalog.changed(catalog.rows_of(remove), list(add), added)
    if catalog.attributes is not None:
        new.attributes = _carried(catalog, source)
    return new


def _codes_of(catalog: ItemCatalog, add: Mapping[str, Any]) -> np.ndarray:
    """(len(add), levels) int64 codes of the added items, checked against the catalog."""
    if not add:
        return np.zeros((0, catalog.num_levels), dtype=np.int64)
    # Code tokens are read, and checked against the codebook, as an index file's are.
    tokens = {i: c for i, c in add.items() if not _all_ints(c)}
    parsed = ItemCatalog.from_index_dict(tokens, catalog.codebook_size) if tokens else None
    rows = []
    for item, codes in add.items():
        if _all_ints(codes):
            row = [int(c) for c in codes]
        else:
            if parsed.level_names != catalog.level_names:
                raise XgrError(
                    f"item {item!r}: levels {list(parsed.level_names)}, the catalog's are "
                    f"{list(catalog.level_names)}"
                )
            row = parsed.codes[parsed.item_index[item]].tolist()
        if len(row) != catalog.num_levels:
            raise XgrError(
                f"item {item!r}: {len(row)} codes, the catalog has {catalog.num_levels} levels"
            )
        if min(row) < 0 or max(row) >= catalog.codebook_size:
            raise XgrError(
                f"item {item!r}: codes {row} outside the codebook [0, {catalog.codebook_size})"
            )
        rows.append(row)
    return np.array(rows, dtype=np.int64)


def _all_ints(codes: Any) -> bool:
    return (
        isinstance(codes, list | tuple)
        and bool(codes)
        and all(isinstance(c, int | np.integer) and not isinstance(c, bool) for c in codes)
    )


def _carried(old: ItemCatalog, rows: np.ndarray) -> ItemAttributes:
    """``old``'s attribute columns at ``rows`` ((N,) int64; -1: an item it lacks, no
    value), the new catalog's items in order."""
    known = rows >= 0
    columns = {}
    for name, column in old.attributes.columns.items():
        values = np.zeros(len(rows), dtype=column.values.dtype)
        present = np.zeros(len(rows), dtype=bool)
        values[known] = column.values[rows[known]]
        present[known] = column.present[rows[known]]
        columns[name] = Column(column.kind, values, present, column.vocabulary)
    return ItemAttributes(columns)


def _with_values(catalog: ItemCatalog, changes: Mapping[str, Mapping[str, Any]]) -> ItemAttributes:
    """The catalog's attributes with ``changes`` applied (new copies of the columns)."""
    if catalog.attributes is None:
        raise XgrError("set_attributes needs a catalog with attributes (load them first)")
    if not isinstance(changes, Mapping):
        raise XgrError("set_attributes must be an object of item id -> {attribute: value}")
    old = catalog.attributes.columns
    columns = {
        n: Column(c.kind, c.values.copy(), c.present.copy(), c.vocabulary) for n, c in old.items()
    }
    vocabularies = {n: {v: i for i, v in enumerate(c.vocabulary)} for n, c in columns.items()}
    for item, values in changes.items():
        row = catalog.item_index.get(str(item))
        if row is None:
            raise XgrError(f"set_attributes: item {item!r} is not in the catalog")
        if not isinstance(values, Mapping):
            raise XgrError(f"set_attributes: item {item!r} needs an object of attribute values")
        for name, value in values.items():
            if name not in columns:
                known = ", ".join(sorted(columns)) or "none"
                raise XgrError(
                    f"set_attributes: unknown attribute {name!r} (the catalog's: {known})"
                )
            column = columns[name]
            if value is None:
                column.present[row] = False
                continue
            column.values[row] = encode_value(name, column.kind, value, vocabularies[name])
            column.present[row] = True
    return ItemAttributes(
        {n: Column(c.kind, c.values, c.present, tuple(vocabularies[n])) for n, c in columns.items()}
    )


def _names(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(repr(i) for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
