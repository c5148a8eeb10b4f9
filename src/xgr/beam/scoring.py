"""How a level's codes are scored: log-probabilities from the LM-head rows of the level's
codes, normalized over the full vocabulary (``CodeScorer``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.beam.logits import (
    code_log_probs,
    distinct_code_mask,
    full_vocab_partials,
    level_head_weights,
)


@dataclass(frozen=True)
class CodeScorer:
    """Scores the codes of each level from hidden states.

    Attributes:
        sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code.
        level_weights: (num_levels, codebook_size, hidden) LM-head rows of each level's
            codes: float32, or the model dtype for a float16/bfloat16 head on CUDA (the
            same values; ``code_log_probs`` then takes a tensor-core GEMM with float32
            output).
        code_mask: (num_levels, codebook_size) bool, True for the codes that are distinct
            in-vocabulary tokens: the set each level's scores are normalized over without
            the full vocabulary, and whose float32 logits replace their rounded ones in the
            full-vocabulary normalizer.
        lm_head: (vocab_size, hidden) the full LM head whose log-sum-exp normalizes the
            scores (exact log-probabilities, as HF ``generate``); None normalizes over each
            level's codes (for vocabularies of codes only).
        vocab_size: the model's vocabulary size.
    """

    sid_token_ids: torch.Tensor
    level_weights: torch.Tensor
    code_mask: torch.Tensor
    lm_head: torch.Tensor | None
    vocab_size: int

    @classmethod
    def build(
        cls, lm_head: torch.Tensor, sid_token_ids: torch.Tensor, full_vocab: bool = True
    ) -> CodeScorer:
        """A scorer over ``lm_head`` ((vocab_size, hidden) weight) for the codes of
        ``sid_token_ids``; ``full_vocab`` False normalizes over each level's codes."""
        head = lm_head.detach()
        weights = level_head_weights(head, sid_token_ids)
        if head.is_cuda and head.dtype != torch.float32:
            weights = weights.to(head.dtype)  # exact: the rows were in this dtype
        vocab_size = head.shape[0]
        mask = distinct_code_mask(sid_token_ids, vocab_size)
        return cls(sid_token_ids, weights, mask, head if full_vocab else None, vocab_size)

    @property
    def full_vocab(self) -> bool:
        return self.lm_head is not None

    def code_tokens(self, level: int, codes: torch.Tensor) -> torch.Tensor:
        """Vocabulary ids of level ``level``'s codes (any shape, int64): the tokens a
        decode step feeds back. Ids outside the vocabulary (codes without a token) are
        clamped into it; such codes score -inf and are never live."""
        return self.sid_token_ids[level][codes].clamp(0, self.vocab_size - 1)

    def log_probs(
        self, hidden: torch.Tensor, level: int, partials: torch.Tensor | None = None
    ) -> torch.Tensor:
        """(N, hidden) model dtype -> (N, codebook_size) float32 log-probabilities of the
        level's codes (``partials``: as ``code_log_probs``'s)."""
        weight, mask = self.level_weights[level], self.code_mask[level]
        return code_log_probs(hidden, weight, self.lm_head, mask, partials)

    def log_probs_of_levels(self, rows: list[tuple[torch.Tensor, int]]) -> list[torch.Tensor]:
        """``log_probs`` of several (hidden, level) row sets.

        On CUDA the full-vocabulary normalizer of all their rows comes from one pass over
        the LM head: level 0 has one row a request, and alone it would read the whole head
        for a matrix-vector product, where beside the next level's hundreds of rows it adds
        a row to a GEMM that reads the head anyway.
        """
        if len(rows) == 1 or self.lm_head is None or not rows[0][0].is_cuda:
            return [self.log_probs(hidden, level) for hidden, level in rows]
        partials = full_vocab_partials(torch.cat([hidden for hidden, _ in rows]), self.lm_head)
        out, start = [], 0
        for hidden, level in rows:
            out.append(self.log_probs(hidden, level, partials[start : start + hidden.shape[0]]))
            start += hidden.shape[0]
        return out
