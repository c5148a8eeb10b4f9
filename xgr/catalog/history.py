"""Resolving a user's history, as people write it, into catalog items."""

from __future__ import annotations

import difflib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from xgr.catalog.catalog import ItemCatalog
from xgr.core import XgrError

MAX_NAMED_UNKNOWN = 20


@dataclass
class ResolvedHistory:
    """A history resolved against the catalog.

    Attributes:
        item_ids: one catalog item per entry, oldest first (what the prompt is built from).
        excluded: every item the history stands for (semantic-ID entries stand for all the
            items that share the ID), to leave out of the recommendations.
    """

    item_ids: list[str] = field(default_factory=list)
    excluded: set[str] = field(default_factory=set)


def resolve_history(
    catalog: ItemCatalog,
    entries: Sequence[str | int],
    titles: Mapping[str, str] | None = None,
) -> ResolvedHistory:
    """Turn history entries into catalog items.

    Each entry is tried, in order, as: an item id (str or int); a semantic ID such as
    ``"<a_1><b_2><c_3>"`` (its first item in catalog order builds the prompt); an exact
    title (``"Godfather, The (1972)"``); a title ignoring case and repeated spaces. When
    several items share a title, the first in catalog order is taken.

    Args:
        catalog: the served catalog.
        entries: the user's items, oldest first.
        titles: item id -> title; without it titles are not looked up.

    Raises:
        XgrError: naming every entry that matched nothing (up to 20), with close titles
            when titles are known.
    """
    exact, folded = _title_index(catalog, titles or {})
    resolved = ResolvedHistory()
    unknown: list[str] = []
    for entry in entries:
        text = str(entry)
        if text in catalog.item_index:
            resolved.item_ids.append(text)
            resolved.excluded.add(text)
            continue
        if text.startswith("<"):
            try:
                items = catalog.items_of_semantic_id(
                    catalog.find_semantic_id(catalog.parse_semantic_id(text))
                )
            except XgrError:
                unknown.append(text)
                continue
            resolved.item_ids.append(items[0])
            resolved.excluded.update(items)
            continue
        item_id = exact.get(text.strip()) or folded.get(_fold(text))
        if item_id is None:
            unknown.append(text)
            continue
        resolved.item_ids.append(item_id)
        resolved.excluded.add(item_id)
    if unknown:
        raise XgrError(_unknown_message(unknown, exact, folded))
    return resolved


def _title_index(
    catalog: ItemCatalog, titles: Mapping[str, str]
) -> tuple[dict[str, str], dict[str, str]]:
    exact: dict[str, str] = {}
    folded: dict[str, str] = {}
    for item_id in catalog.item_ids:
        title = titles.get(item_id)
        if title is not None:
            exact.setdefault(title, item_id)
            folded.setdefault(_fold(title), item_id)
    return exact, folded


def _fold(title: str) -> str:
    return " ".join(title.split()).casefold()


def _unknown_message(unknown: list[str], exact: dict[str, str], folded: dict[str, str]) -> str:
    shown = ", ".join(repr(u[:64]) for u in unknown[:MAX_NAMED_UNKNOWN])
    more = len(unknown) - MAX_NAMED_UNKNOWN
    message = f"unknown items in history: {shown}" + (f" and {more} more" if more > 0 else "")
    if exact:
        close = difflib.get_close_matches(_fold(unknown[0]), list(folded), n=5, cutoff=0.5)
        by_fold = {_fold(title): title for title in exact}
        if close:
            message += f"; titles close to {unknown[0]!r}: " + ", ".join(
                repr(by_fold[c]) for c in close
            )
        else:
            message += "; give item ids, semantic IDs or titles with their year"
    return message
