"""One version of the served catalog with everything the search derives from it: the trie on
the device, the rules' masks, the runner and scorer that read the catalog's first-level
codes (``CatalogVersion``). A batch reads one version from launch to result."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.catalog import ItemCatalog, TitleIndex
from xgr.catalog.rules import CatalogMasks
from xgr.engine.spec import DecodeSpec


@dataclass(frozen=True)
class CatalogVersion:
    """A catalog version and its device tables.

    Attributes:
        version: its number (1 for the catalog the engine started with; each accepted update
            the next; a rollback returns to an earlier one's number).
        catalog: the items (host).
        spec: runner, scorer and the trie on the device (``DecodeSpec``).
        masks: the per-request rule masks over this trie (``CatalogMasks``).
        title_index: title lookups of history entries over this catalog.
    """

    version: int
    catalog: ItemCatalog
    spec: DecodeSpec
    masks: CatalogMasks
    title_index: TitleIndex

    @classmethod
    def build(
        cls,
        version: int,
        catalog: ItemCatalog,
        model: torch.nn.Module,
        sid_token_ids: torch.Tensor,
        titles: dict[str, str],
        full_vocab: bool,
        attention_backend: str,
        first_levels_together: bool,
        previous: DecodeSpec | None = None,
    ) -> CatalogVersion:
        """Build a version's tables (the trie copied to the model's device, the first
        codes read once: a host synchronization, off the request path).

        Args:
            sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code on
                the model's device (checked against the catalog by the caller).
            previous: a spec whose runner (and so its prefill graphs) this version may
                share (``DecodeSpec.build``).
            Others: as ``DecodeSpec.build``.
        """
        trie = catalog.trie.to(sid_token_ids.device)
        spec = DecodeSpec.build(
            model, trie, sid_token_ids, full_vocab, attention_backend, first_levels_together,
            previous,
        )  # fmt: skip
        return cls(version, catalog, spec, CatalogMasks(catalog, trie), TitleIndex(catalog, titles))
