"""Resolving a user's history, as people write it, into catalog items."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

from xgr.catalog.catalog import ItemCatalog
from xgr.core import XgrError

MAX_NAMED_UNKNOWN = 20
# difflib is quadratic-ish in the number of titles: suggestions only for catalogs this small.
MAX_TITLES_FOR_SUGGESTIONS = 20_000


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


def history_entries(history: object) -> list:
    """A history as a list of its entries, refusing what is not a list of items.

    A bare string would otherwise be read character by character ("12" as items 1 and 2).

    Raises:
        XgrError: a string, bytes, a mapping or anything not iterable.
    """
    if isinstance(history, str | bytes):
        shown = history[:40]
        raise XgrError(f"a history is a list of items, got the string {shown!r} ([{shown!r}]?)")
    if isinstance(history, Mapping) or not isinstance(history, Iterable):
        raise XgrError(f"a history is a list of items, got {type(history).__name__}")
    if isinstance(history, Set):
        raise XgrError("a history is ordered (oldest first): give a list, not a set")
    if getattr(history, "ndim", 1) != 1:  # numpy / torch arrays: one item per element
        raise XgrError(f"a history is a flat list of items, got an array of shape {history.shape}")
    return history.tolist() if hasattr(history, "tolist") else list(history)


class TitleIndex:
    """Catalog items by title, built once per catalog (exact and case-folded lookups).

    Args:
        catalog: the served catalog; titles of items outside it are ignored.
        titles: item id -> title.
    """

    def __init__(self, catalog: ItemCatalog, titles: Mapping[str, str]) -> None:
        self.exact: dict[str, str] = {}
        self.folded: dict[str, str] = {}
        # Titles (case-folded) that several items share -> all of them, in catalog order
        # (MovieLens-100K has 18 such titles); kept apart so unique titles cost no list.
        self._shared: dict[str, list[str]] = {}
        # Over the titled items of the catalog (none: no pass over a million ids).
        titled = catalog.item_ids if titles else ()
        for item_id in titled:
            title = titles.get(item_id)
            if title is not None:
                self.exact.setdefault(title, item_id)
                folded = _fold(title)
                first = self.folded.setdefault(folded, item_id)
                if first != item_id:
                    self._shared.setdefault(folded, [first]).append(item_id)

    def __len__(self) -> int:
        return len(self.exact)

    def lookup(self, text: str) -> str | None:
        """The item titled ``text`` (exactly, else ignoring case and spacing), or None."""
        return self.exact.get(text.strip()) or self.folded.get(_fold(text))

    def items(self, text: str) -> list[str]:
        """Every item titled ``text`` ignoring case and spacing, ``lookup``'s first; [] if
        none."""
        first = self.lookup(text)
        if first is None:
            return []
        return [first] + [i for i in self._shared.get(_fold(text), ()) if i != first]

    def close_titles(self, text: str) -> list[str]:
        """Up to 5 titles close to ``text`` (none for catalogs over 20,000 titles)."""
        if len(self.folded) > MAX_TITLES_FOR_SUGGESTIONS:
            return []
        close = difflib.get_close_matches(_fold(text), list(self.folded), n=5, cutoff=0.5)
        by_fold = {_fold(title): title for title in self.exact}
        return [by_fold[c] for c in close]


def resolve_history(
    catalog: ItemCatalog,
    entries: Sequence[str | int],
    titles: TitleIndex | Mapping[str, str] | None = None,
) -> ResolvedHistory:
    """Turn history entries into catalog items.

    Each entry is tried, in order, as: an item id (str or int); a semantic ID such as
    ``"<a_1><b_2><c_3>"`` (its first item in catalog order builds the prompt); an exact
    title (``"Godfather, The (1972)"``); a title ignoring case and repeated spaces. When
    several items share a title, the first in catalog order builds the prompt and all of
    them are excluded (as for a semantic ID's items).

    Args:
        catalog: the served catalog.
        entries: the user's items, oldest first.
        titles: a ``TitleIndex`` (or item id -> title); without it titles are not looked up.

    Raises:
        XgrError: naming every entry that matched nothing (up to 20), with close titles
            when titles are known; ``entries`` not a list (``history_entries``).
    """
    entries = history_entries(entries)
    index = catalog.item_index
    if all(type(entry) is str and entry in index for entry in entries):
        # The common case, item ids alone, without an entry-by-entry lookup (a serving
        # request's history of hundreds of items is resolved on every call).
        return ResolvedHistory(list(entries), set(entries))
    if titles is not None and not isinstance(titles, TitleIndex):
        titles = TitleIndex(catalog, titles)
    resolved = ResolvedHistory()
    unknown: list[str] = []
    for entry in entries:
        text = str(entry)
        items = _lookup(catalog, text, titles)
        if not items:
            unknown.append(text)
            continue
        resolved.item_ids.append(items[0])
        resolved.excluded.update(items)
    if unknown:
        raise XgrError(_unknown_message(unknown, titles))
    return resolved


def _lookup(catalog: ItemCatalog, text: str, titles: TitleIndex | None) -> list[str]:
    """The items an entry stands for (first: the one for the prompt), or [] if none."""
    if text in catalog.item_index:
        return [text]
    if text.startswith("<"):
        try:
            codes = catalog.parse_semantic_id(text)
        except XgrError:
            pass  # maybe a title that starts with "<"
        else:
            return catalog.items_of_semantic_id(catalog.find_semantic_id(codes))
    return titles.items(text) if titles is not None else []


def _fold(title: str) -> str:
    return " ".join(title.split()).casefold()


def _unknown_message(unknown: list[str], titles: TitleIndex | None) -> str:
    shown = ", ".join(repr(u[:64]) for u in unknown[:MAX_NAMED_UNKNOWN])
    more = len(unknown) - MAX_NAMED_UNKNOWN
    message = f"unknown items in history: {shown}" + (f" and {more} more" if more > 0 else "")
    if titles:
        close = titles.close_titles(unknown[0][:256])
        if close:
            message += f"; titles close to {unknown[0][:64]!r}: " + ", ".join(map(repr, close))
        else:
            message += "; give item ids, semantic IDs or titles with their year"
    return message
