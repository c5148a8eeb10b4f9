"""One named catalog that an engine serves: its current version, the earlier ones a rollback
returns to, and the lock that lets one update build at a time (``ServedCatalog``)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Mapping
from typing import Any

from xgr.catalog import ItemCatalog
from xgr.core import CATALOG_NAME, DEFAULT_CATALOG, XgrError
from xgr.engine.catalog_version import CatalogVersion

# Versions kept for rollback, per catalog (each holds its device tables).
MAX_EARLIER_VERSIONS = 4


class ServedCatalog:
    """A catalog's versions (``Engine.catalogs``).

    ``current`` is one reference, replaced whole: a batch reads it once at launch and keeps
    that version to its result, so no batch mixes versions.

    Args:
        name: the catalog's name (what a request's ``catalog`` gives).
        first: its first version (number 1).
    """

    def __init__(self, name: str, first: CatalogVersion) -> None:
        self.name = name
        self.current = first
        self._earlier: list[CatalogVersion] = []
        self._last_number = first.version
        self._updating = threading.Lock()

    @property
    def version(self) -> int:
        """The current version's number."""
        return self.current.version

    @property
    def catalog(self) -> ItemCatalog:
        """The current version's items."""
        return self.current.catalog

    def publish(self, build: Callable[[CatalogVersion, int], CatalogVersion]) -> CatalogVersion:
        """Serve the version ``build(current, number)`` makes, under the update lock (one
        update at a time; requests go on meanwhile with the current version).

        Returns:
            The new version, now current.

        Raises:
            Whatever ``build`` raises (an update it refuses); nothing changes then.
        """
        with self._updating:
            current = self.current
            version = build(current, self._last_number + 1)
            self._last_number = version.version
            self._earlier.append(current)
            del self._earlier[:-MAX_EARLIER_VERSIONS]
            self.current = version
            return version

    def rollback(
        self, prepare: Callable[[CatalogVersion, CatalogVersion], None] | None = None
    ) -> CatalogVersion:
        """Serve the version before the current one again.

        Args:
            prepare: called as ``prepare(that version, current)`` under the update lock
                before it is served.

        Returns:
            That version, now current.

        Raises:
            XgrError: no earlier version is kept.
        """
        with self._updating:
            if not self._earlier:
                raise XgrError(
                    f"no earlier catalog version of {self.name!r} to roll back to (version "
                    f"{self.version} is the first kept)"
                )
            if prepare is not None:
                prepare(self._earlier[-1], self.current)
            self.current = self._earlier.pop()
            return self.current


def named_catalogs(catalog: Any) -> dict[str, ItemCatalog]:
    """An engine's catalogs by name: one catalog as ``{DEFAULT_CATALOG: catalog}``, or a
    mapping of names to catalogs (in its order, the first the default).

    Raises:
        XgrError: an empty mapping, a name that is not 1-64 letters, digits, ``_``, ``.``
            or ``-`` (starting with a letter or digit), or a value that is not an
            ``ItemCatalog``.
    """
    catalogs = {DEFAULT_CATALOG: catalog} if isinstance(catalog, ItemCatalog) else catalog
    if not isinstance(catalogs, Mapping) or not catalogs:
        raise XgrError(
            "catalog must be an ItemCatalog or a non-empty mapping of names to catalogs, got "
            f"{type(catalog).__name__}"
        )
    seen: set[int] = set()
    named = {}
    for name, items in catalogs.items():
        if not isinstance(name, str):
            raise XgrError(f"catalog names must be strings, got {type(name).__name__} {name!r}")
        if not CATALOG_NAME.fullmatch(name):
            raise XgrError(
                f"catalog name {str(name)[:80]!r} must be 1-64 letters, digits, '_', '.' or "
                "'-', starting with a letter or digit"
            )
        if not isinstance(items, ItemCatalog):
            raise XgrError(f"catalog {name!r} must be an ItemCatalog, got {type(items).__name__}")
        # One object under two names would share its attributes and later changes.
        named[name] = copy.copy(items) if id(items) in seen else items
        seen.add(id(items))
    return named
