"""The prompt-KV pool that a model's CUDA graphs read and write (``xgr.engine.cuda_graph``):
one buffer reused by every batch, so that the graphs hold one address."""

from __future__ import annotations

import logging

import torch

from xgr.kv import SharedKV, kv_buffers

logger = logging.getLogger(__name__)

# The pool grows in powers of two from this many tokens.
MIN_POOL_TOKENS = 4096


class PromptKVPool:
    """Prompt K/V buffers of a model's shared-KV layout, grown on demand.

    Args:
        model: a ``CausalLM`` (its layers' prompt K/V) or ``T5Seq2SeqLM`` (its decoder
            layers' cross-attention K/V, token-major).
    """

    def __init__(self, model) -> None:
        self.model = model
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.token_major: torch.Tensor | None = None  # what k and v view, if any

    @property
    def tokens(self) -> int:
        """Tokens the pool holds (0 before the first ``grow``)."""
        return 0 if self.k is None else self.k.shape[1]

    def view(self, cu_seqlens: torch.Tensor, seqlens: list[int]) -> SharedKV:
        """The pool as a batch's ``SharedKV`` with these prompt offsets."""
        return SharedKV(self.k, self.v, cu_seqlens, seqlens, self.token_major)

    def release(self) -> None:
        """Drop the buffers (the next ``grow`` makes new ones)."""
        self.k = self.v = self.token_major = None

    def grow(self, num_tokens: int) -> None:
        """New buffers of the smallest ``MIN_POOL_TOKENS`` x 2**n tokens >= num_tokens,
        after the device finished with the old ones (a launched batch may read them); the
        caller drops whatever holds the old buffers' address (captured graphs)."""
        tokens = MIN_POOL_TOKENS
        while tokens < num_tokens:
            tokens *= 2
        layers, heads, head_dim = self.model.shared_kv_layout
        weight = self.model.lm_head.weight
        if self.k is not None and self.k.is_cuda:
            torch.cuda.synchronize(weight.device)
        self.k = self.v = self.token_major = None
        self.k, self.v, self.token_major = kv_buffers(
            layers, tokens, heads, head_dim, weight.dtype, weight.device,
            self.model.token_major_shared_kv,
        )  # fmt: skip
        gib = 2 * self.k.nbytes / 2**30
        logger.info("prompt-KV pool: %d tokens (%.2f GiB)", tokens, gib)
