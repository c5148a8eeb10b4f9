"""What the decode levels of a batch need besides the batch itself: the model, the
catalog's trie and how the codes are scored (``DecodeSpec``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.beam.logits import (
    code_log_probs,
    distinct_code_mask,
    full_vocab_partials,
    level_head_weights,
)
from xgr.catalog.trie import PrefixTrie
from xgr.models.decoder import CausalLM
from xgr.models.t5 import T5Seq2SeqLM


@dataclass
class DecodeSpec:
    """What the decode levels need besides the batch: model, catalog and scoring.

    Attributes:
        model: the decoder-only LM or the T5 encoder-decoder.
        trie: the catalog's valid-path trie, on the model's device.
        sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code.
        level_weights: (num_levels, codebook_size, hidden) LM-head rows of each level's
            codes: float32, or the model dtype for a float16/bfloat16 model on CUDA (the
            same values; ``code_log_probs`` then takes a tensor-core GEMM with float32
            output).
        code_mask: (num_levels, codebook_size) bool, True for the codes that are distinct
            in-vocabulary tokens: the set each level's scores are normalized over when
            ``full_vocab`` is False, and whose float32 logits replace their rounded ones in
            the full-vocabulary normalizer.
        full_vocab: normalize scores over the whole vocabulary (exact log-probabilities);
            False normalizes over each level's codes (vocabularies of codes only).
        attention_backend: "torch" (reference) or "triton" (GPU kernel) decode attention.
        first_codes: (V0,) int64 the catalog's first-level codes (the trie root's
            children), ascending; None: not computed (``build`` computes it).
        first_nodes: (V0,) int64 trie node (depth 1) of each of ``first_codes``.
    """

    model: CausalLM | T5Seq2SeqLM
    trie: PrefixTrie
    sid_token_ids: torch.Tensor
    level_weights: torch.Tensor
    code_mask: torch.Tensor
    full_vocab: bool = True
    attention_backend: str = "torch"
    first_codes: torch.Tensor | None = None
    first_nodes: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        model: CausalLM | T5Seq2SeqLM,
        trie: PrefixTrie,
        sid_token_ids: torch.Tensor,
        full_vocab: bool = True,
        attention_backend: str = "torch",
    ) -> DecodeSpec:
        head = model.lm_head.weight.detach()
        weights = level_head_weights(head, sid_token_ids)
        if head.is_cuda and head.dtype != torch.float32:
            weights = weights.to(head.dtype)  # exact: the rows were in this dtype
        mask = distinct_code_mask(sid_token_ids, model.config.vocab_size)
        # Read once here (a host sync), so the decode levels index them without one.
        codes, nodes, valid = trie.levels[0].expand(
            torch.zeros(1, dtype=torch.int64, device=sid_token_ids.device)
        )
        first_codes, first_nodes = codes[valid], nodes[valid]
        return cls(
            model, trie, sid_token_ids, weights, mask, full_vocab, attention_backend,
            first_codes, first_nodes,
        )  # fmt: skip

    def log_probs(
        self, hidden: torch.Tensor, level: int, partials: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N, hidden) -> (N, codebook_size) float32 log-probabilities of the level's codes
        (``partials``: as ``code_log_probs``'s)."""
        full = self.model.lm_head.weight if self.full_vocab else None
        weight, mask = self.level_weights[level], self.code_mask[level]
        return code_log_probs(hidden, weight, full, mask, partials)

    def log_probs_of_levels(self, rows: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """``log_probs`` of several (hidden, level) row sets; on CUDA the full-vocabulary
        normalizer of all their rows comes from one pass over the LM head. Level 0 has one
        row a request, and alone it reads the whole head for a matrix-vector product
        (Qwen3-1.7B: 151,936 x 2,048, ~0.15 ms on an H200), where beside the next level's
        hundreds of rows it adds a row to a GEMM that reads the head anyway."""
        full = self.model.lm_head.weight if self.full_vocab else None
        if full is None or not rows[0][0].is_cuda:
            return [self.log_probs(hidden, level) for hidden, level in rows]
        partials = full_vocab_partials(torch.cat([hidden for hidden, _ in rows]), full)
        out, start = [], 0
        for hidden, level in rows:
            out.append(self.log_probs(hidden, level, partials[start : start + hidden.shape[0]]))
            start += hidden.shape[0]
        return out
