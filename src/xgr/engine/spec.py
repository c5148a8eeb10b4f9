"""What the search of a batch needs besides the batch itself: the model's runner, how codes
are scored and the catalog's trie (``DecodeSpec``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.beam.scoring import CodeScorer
from xgr.catalog.trie import PrefixTrie
from xgr.runner import ModelRunner, runner_for


@dataclass(frozen=True, eq=False, repr=False)
class DecodeSpec:
    """The model's runner, the code scorer and the catalog's trie; compared by identity
    (the decode graphs captured over one are kept under it), and shown as the object it
    is (its tables are too large to print in a log line).

    Attributes:
        runner: the model family's passes (``xgr.runner``).
        scorer: each level's code log-probabilities (``xgr.beam.scoring.CodeScorer``).
        trie: the catalog's valid-path trie, on the model's device.
        first_codes: (V0,) int64 the catalog's first-level codes (the trie root's
            children), ascending.
        first_nodes: (V0,) int64 trie node (depth 1) of each of ``first_codes``.
    """

    runner: ModelRunner
    scorer: CodeScorer
    trie: PrefixTrie
    first_codes: torch.Tensor
    first_nodes: torch.Tensor

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        trie: PrefixTrie,
        sid_token_ids: torch.Tensor,
        full_vocab: bool = True,
        attention_backend: str = "torch",
        first_levels_together: bool = True,
        previous: DecodeSpec | None = None,
    ) -> DecodeSpec:
        """The spec of ``model`` (a ``CausalLM`` or ``T5Seq2SeqLM``) over ``trie``.

        Args:
            sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code,
                on the model's device.
            full_vocab: normalize scores over the whole vocabulary (``CodeScorer``).
            attention_backend: "torch" (reference) or "triton" decode attention.
            first_levels_together: let level 1's forward run inside the pass before it
                where the beam holds every first-level code (the runner decides where).
            previous: a spec of the same model (another catalog, or this one's previous
                version) whose runner is reused where the first-level codes map to the same
                tokens: the runner reads nothing else of the catalog, so the prefill graphs
                captured with it serve this spec too.
        """
        scorer = CodeScorer.build(model.lm_head.weight, sid_token_ids, full_vocab)
        # Read once here (a host sync), so the decode levels index them without one.
        codes, nodes, valid = trie.levels[0].expand(
            torch.zeros(1, dtype=torch.int64, device=sid_token_ids.device)
        )
        first_codes, first_nodes = codes[valid], nodes[valid]
        first_tokens = scorer.code_tokens(0, first_codes)
        if previous is not None and _same(first_tokens, previous.first_tokens):
            runner = previous.runner
        else:
            runner = runner_for(
                model, len(trie.levels), first_tokens, attention_backend, first_levels_together
            )
        return cls(runner, scorer, trie, first_codes, first_nodes)

    @property
    def first_tokens(self) -> torch.Tensor:
        """(V0,) int64 vocabulary id of each of ``first_codes``."""
        return self.scorer.code_tokens(0, self.first_codes)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.equal(a, b))
