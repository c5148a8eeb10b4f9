"""What a server that is one of several replicas of a model shares with the others
(``Replicas``): whether all of them run, their metrics in one scrape, and catalog changes
applied to every one in one order. ``xgr.server.ray_serve`` implements it on Ray."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class CatalogChange:
    """One change of a served catalog, as the admin API received it.

    Attributes:
        catalog: the catalog's name.
        update: the ``POST /v1/catalog`` body (a dict); None for a rollback.
    """

    catalog: str
    update: dict[str, Any] | None = None


class Replicas(Protocol):
    """A replica's view of its siblings (``create_app(..., replicas=)``)."""

    def start(
        self, apply: Callable[[CatalogChange], Any] | None, metrics: Callable[[], bytes]
    ) -> None:
        """Apply, with ``apply``, every change the replicas made so far, then go on applying
        the others' changes as they come and sharing this replica's ``metrics()`` (called
        before this replica takes requests; ``apply`` None: the admin API is off)."""

    def stop(self) -> None:
        """Stop following the others' changes."""

    def waiting(self) -> str | None:
        """Why not every replica runs yet (``/ready`` is 503 meanwhile); None once all do."""

    def metrics(self, own: bytes) -> bytes:
        """The Prometheus text of every replica (``own``: this one's), each sample labelled
        with its replica."""

    def change(self, change: CatalogChange, apply: Callable[[CatalogChange], Any]) -> Any:
        """Apply ``change`` here with ``apply`` (its refusal raised, nothing changed
        anywhere), one change at a time across the replicas, and return what ``apply``
        returned once every running replica has applied it.

        Raises:
            XgrError: ``apply``'s refusal, or a replica failed to apply it.
        """
