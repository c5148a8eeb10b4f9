"""Which CUDA graphs a batch replays (``GraphPlan``): its prefill's padded shape
(``xgr.runner.PrefillShape``) and its decode levels' ``DecodeGraphKey``."""

from __future__ import annotations

from dataclasses import dataclass

from xgr.runner import PrefillShape

# An encoder graph under SDPA builds an attention mask (slots x heads x P x P, model dtype),
# its largest buffer; prefills whose mask would pass this run eagerly.
MAX_GRAPH_WORKSPACE_BYTES = 1 << 30


@dataclass(frozen=True)
class DecodeGraphKey:
    """A decode graph: every level's selection, decode forward and KV bookkeeping of a
    batch; prompt lengths enter only through device tensors.

    Attributes:
        requests: requests in the batch.
        beam_width, top_k: search parameters.
        first_levels_together: level 1's forward runs inside the pass before it
            (``ModelRunner.first_levels_together``).
        filtered: the selections read per-request masks of the trie (some request of the
            batch has item rules; the others' masks allow everything).
    """

    requests: int
    beam_width: int
    top_k: int
    first_levels_together: bool
    filtered: bool = False


@dataclass(frozen=True)
class GraphPlan:
    """How a batch runs: ``prefill`` the shape of its prefill graph, None to prefill
    eagerly; ``decode`` its decode graph's key, None to decode eagerly (then the prefill is
    eager too)."""

    prefill: PrefillShape | None
    decode: DecodeGraphKey | None


EAGER = GraphPlan(None, None)
