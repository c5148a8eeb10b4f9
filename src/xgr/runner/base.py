"""What the engine's search loop asks of a model family (``ModelRunner``), and the
per-pass metadata it hands over: explicit tensors, no model-family fields."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from xgr.kv import BeamKV, SharedKV
from xgr.models.embeds import PromptEmbeds
from xgr.runner.shapes import PrefillShape


@dataclass(frozen=True)
class PrefillBatch:
    """The device inputs of one prefill pass, eager or inside a CUDA graph.

    Attributes:
        tokens: (T,) int64 the prompts packed in request order (a graph: then padding).
        positions: (T,) int64 each token's position in its prompt; None where the model
            reads none (an encoder).
        shared: where the pass writes the prompt KV (decoder-only: each layer's; T5: each
            decoder layer's cross-attention K/V of the encoder output).
        attention_offsets_host: host offsets of the sequences the prefill attention sees
            (the prompts; a graph: [0, T], its device offsets keeping them apart).
        attention_offsets: (S + 1,) int32 the same offsets on the device.
        max_seqlen: the longest of those sequences (tokens).
        packed: force (True) or forbid (False) the packed attention launch; None: the
            measured choice of ``prefill_attention``.
        last_index: (R,) int64 packed index of each prompt's last token (a graph: one per
            request slot).
        prompt_lens: (R,) int64 prompt lengths (a graph: one per request slot, 1 for the
            absent ones).
        prompt_offsets: (R + 1,) int64 prompt offsets of the real requests.
        prompt_offsets_host: the same offsets as host ints.
        slot_tokens: an encoder graph pads each prompt to this many tokens; 0 packed.
        code_kv: the one-slot K/V that level 1's rows write when they run in this pass
            (``ModelRunner.allocate_code_kv``); None where level 1 runs after level 0.
        embeds: the input embeddings given for some of ``tokens`` (``PromptEmbeds``); None
            where every position takes its token's.
    """

    tokens: torch.Tensor
    positions: torch.Tensor | None
    shared: SharedKV
    attention_offsets_host: list[int]
    attention_offsets: torch.Tensor
    max_seqlen: int
    packed: bool | None
    last_index: torch.Tensor
    prompt_lens: torch.Tensor
    prompt_offsets: torch.Tensor
    prompt_offsets_host: list[int]
    slot_tokens: int = 0
    code_kv: BeamKV | None = None
    embeds: PromptEmbeds | None = None


@dataclass(frozen=True)
class Prefilled:
    """What a prefill hands to the first decode step.

    Attributes:
        last_hidden: (R, hidden) final hidden state of each prompt's last token, model
            dtype; None where the first step starts from a token of its own (T5's decoder
            start token).
        code_hidden: (R * V0, hidden) final hidden states of level 1's rows when they ran
            in the prefill, request-major in first-code order; else None.
        code_kv: the one-slot K/V those rows wrote; else None.
    """

    last_hidden: torch.Tensor | None = None
    code_hidden: torch.Tensor | None = None
    code_kv: BeamKV | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The hidden states held, in field order (a decode graph's copied inputs)."""
        return tuple(t for t in (self.last_hidden, self.code_hidden) if t is not None)

    def narrow(self, num_requests: int) -> Prefilled:
        """The first ``num_requests`` prompts' last hidden states (a graph's output holds
        one per request slot)."""
        if self.last_hidden is None:
            return self
        return Prefilled(self.last_hidden[:num_requests], self.code_hidden, self.code_kv)

    def like(self) -> Prefilled:
        """Empty buffers of the same shapes (a decode graph's static inputs); the same
        ``code_kv``, which a graph reads at its address."""
        empty = [None if t is None else torch.empty_like(t) for t in
                 (self.last_hidden, self.code_hidden)]  # fmt: skip
        return Prefilled(*empty, self.code_kv)


@dataclass(frozen=True)
class LevelBatch:
    """What every decode step of a batch reads besides the beams.

    Attributes:
        shared: the batch's prompt KV (filled by the prefill); ``shared.cu_seqlens`` the
            (R + 1,) int64 prompt offsets the kernels read.
        prompt_lens: (R,) int64 prompt lengths on the device.
        prompt_offsets_host: R + 1 host prompt offsets (read by the torch reference
            attention only).
        allowed: per level, the (R, nodes at depth level + 1) bool children each request
            may take (its item rules, ``xgr.catalog.rules.CatalogMasks``); None: all.
    """

    shared: SharedKV
    prompt_lens: torch.Tensor
    prompt_offsets_host: list[int]
    allowed: tuple[torch.Tensor, ...] | None = None

    def allowed_at(self, level: int) -> torch.Tensor | None:
        """The children each request may take at ``level``'s selection, or None."""
        return None if self.allowed is None else self.allowed[level]

    @property
    def num_requests(self) -> int:
        return len(self.prompt_offsets_host) - 1


@dataclass(frozen=True)
class FirstStep:
    """The first decode step's rows to score, and the beams' K/V after it.

    Attributes:
        rows: (hidden, level) row sets to score: level 0's (R, hidden), and, where level 1's
            forward already ran (every first-level code kept), its (R * V0, hidden) rows,
            request-major in first-code order.
        beam: the beams' K/V with the slots written so far (``beam.length``).
        parent_stride, parent_offset: the next reorder's layout: beam p of request r
            continues the written slots of row r * parent_stride + parent_offset + p.
    """

    rows: tuple[tuple[torch.Tensor, int], ...]
    beam: BeamKV
    parent_stride: int
    parent_offset: int


class FamilyRunner:
    """What every family's runner holds, and where level 1 may join the pass before it.

    Args:
        model: the model, on its device and dtype.
        num_levels: levels of the catalog's semantic IDs.
        first_code_tokens: (V0,) int64 vocabulary ids of the catalog's first-level codes,
            ascending by code; None: level 1 always runs after level 0.
        attention_backend: "torch" (reference) or "triton" decode attention.
        first_levels_together: allow level 1's forward inside the pass before it (where it
            applies); False always runs it after level 0.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_levels: int,
        first_code_tokens: torch.Tensor | None,
        attention_backend: str = "torch",
        first_levels_together: bool = True,
    ) -> None:
        self.model = model
        self.num_levels = num_levels
        self.first_code_tokens = first_code_tokens
        self.attention_backend = attention_backend
        self.together_allowed = first_levels_together

    @property
    def hidden_size(self) -> int:
        """Width of the model's input embeddings (a prompt's given ones must match)."""
        return self.model.lm_head.weight.shape[1]

    @property
    def num_first_codes(self) -> int:
        """V0: the catalog's first-level codes (0 without ``first_code_tokens``)."""
        return 0 if self.first_code_tokens is None else self.first_code_tokens.shape[0]

    def _beam_holds_first_codes(self, beam_width: int) -> bool:
        """Whether level 0 keeps every first-level code whatever their scores (so level
        1's forward may run before they are scored), and is allowed to."""
        return (
            self.together_allowed
            and self.first_code_tokens is not None
            and self.num_levels >= 2
            and self.num_first_codes <= beam_width
        )


class ModelRunner(Protocol):
    """One model family's passes, as the engine's one search loop calls them
    (``xgr.engine.search``).

    A runner writes the prompt KV in ``prefill``, starts the beams in ``first_step`` and
    runs one level's forward for the live beams in ``forward_level``. Whether level 1's
    forward runs inside the pass before it (``first_levels_together``) is the runner's
    own decision; the loop only reads how many levels ``first_step`` scored.
    """

    model: torch.nn.Module
    prompt_limit: str  # what bounds a prompt (``max_prompt_tokens``), for error messages

    @property
    def max_prompt_tokens(self) -> int:
        """Longest prompt the model takes (tokens)."""

    @property
    def hidden_size(self) -> int:
        """Width of the model's input embeddings."""

    def first_levels_together(self, num_requests: int, beam_width: int) -> bool:
        """Whether level 1's forward runs in the pass before it for such a batch."""

    def prefill_shape(
        self, prompt_lens: list[int], max_requests: int, together: bool
    ) -> PrefillShape | None:
        """The padded prefill a CUDA graph would run for these prompts; None where this
        model's prefill of such a batch never replays a graph."""

    def allocate_code_kv(self, num_requests: int) -> BeamKV | None:
        """The one-slot K/V that level 1's rows of a prefill write; None where level 1
        never runs inside the prefill."""

    def prefill(self, batch: PrefillBatch) -> Prefilled:
        """Run the prompts once, writing ``batch.shared``."""

    def first_step(
        self, batch: LevelBatch, prefilled: Prefilled, beam_width: int, together: bool
    ) -> FirstStep:
        """Start the beams: the rows whose scores level 0 (and level 1) select from."""

    def forward_level(
        self, batch: LevelBatch, beam: BeamKV, ids: torch.Tensor, level: int, width: int
    ) -> torch.Tensor:
        """Level ``level``'s forward over (R * width,) int64 token ids (the previous code
        of each request's first ``width`` beams, request-major), writing slot
        ``beam.length``; returns (R * width, hidden) head inputs, model dtype."""
