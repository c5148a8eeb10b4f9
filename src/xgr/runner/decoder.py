"""The runner of decoder-only models (Qwen2, Qwen3, Llama): a causal prefill over the packed
prompts, then one decode forward a level over the live beams."""

from __future__ import annotations

import torch

from xgr.kv import BeamKV, SharedKV
from xgr.layers.attention import DecodeMetadata, PrefillMetadata
from xgr.runner.base import FamilyRunner, FirstStep, LevelBatch, PrefillBatch, Prefilled
from xgr.runner.shapes import PrefillShape, packed_shape


class DecoderRunner(FamilyRunner):
    """``ModelRunner`` of a ``CausalLM``.

    The prompt's last token gives level 0's scores. For a single request whose beam holds
    every first-level code of the catalog, level 1's forward joins the prefill: level 0
    keeps all those codes whatever their scores, so each runs as a row after the prompt
    (one position after it), attending over the prompt and itself and writing its K/V into
    a one-slot ``BeamKV`` (``PrefillMetadata.first_codes``): one pass over the weights
    instead of two. Batches of several requests keep the steps apart: the packed prefill
    graphs pad to a fixed number of request slots, whose code rows would follow the padding.

    Args: as ``FamilyRunner``'s, ``model`` a ``CausalLM``.
    """

    # What bounds a prompt, for error messages.
    prompt_limit = "max positions minus generated codes"

    @property
    def max_prompt_tokens(self) -> int:
        """Positions must cover the generated codes too."""
        return self.model.config.max_position_embeddings - self.num_levels + 1

    def first_levels_together(self, num_requests: int, beam_width: int) -> bool:
        return num_requests == 1 and self._beam_holds_first_codes(beam_width)

    def prefill_shape(
        self, prompt_lens: list[int], max_requests: int, together: bool
    ) -> PrefillShape | None:
        """The packed shape (``packed_shape``); None for several float32 prompts, which the
        packed attention launch (fp16/bf16) does not take."""
        float32 = self.model.lm_head.weight.dtype == torch.float32
        if len(prompt_lens) > 1 and float32:
            return None
        return packed_shape(prompt_lens, max_requests, self.num_first_codes if together else 0)

    def allocate_code_kv(self, num_requests: int) -> BeamKV:
        cfg, weight = self.model.config, self.model.lm_head.weight
        rows = num_requests * self.num_first_codes
        return BeamKV.allocate(
            cfg.num_layers, rows, 1, cfg.num_kv_heads, cfg.head_dim, weight.dtype, weight.device
        )

    def prefill(self, batch: PrefillBatch) -> Prefilled:
        """Run the packed prompts once, every layer writing its prompt KV into
        ``batch.shared``; with ``batch.code_kv``, level 1's rows follow in the same pass."""
        tokens, positions, first_codes = batch.tokens, batch.positions, None
        if batch.code_kv is not None:
            shared = batch.shared
            codes = SharedKV(shared.k, shared.v, batch.prompt_offsets, [], shared.token_major)
            first_codes = DecodeMetadata(
                codes, batch.code_kv, batch.prompt_offsets_host, self.num_first_codes,
                self.attention_backend,
            )  # fmt: skip
            ids, code_positions = self._code_rows(batch.prompt_lens)
            tokens, positions = torch.cat((tokens, ids)), torch.cat((positions, code_positions))
        meta = PrefillMetadata(
            batch.shared, batch.attention_offsets_host, batch.attention_offsets,
            batch.max_seqlen, packed=batch.packed, output_rows=batch.last_index,
            first_codes=first_codes,
        )  # fmt: skip
        hidden = self.model(tokens, positions, meta, batch.embeds)
        last = batch.last_index.shape[0]
        if batch.code_kv is None:
            return Prefilled(hidden)
        return Prefilled(hidden[:last], hidden[last:], batch.code_kv)

    def _code_rows(self, prompt_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids and positions of level 1's rows: every first-level code of each
        request, at the position after its prompt; (R * V0,) int64 each, request-major."""
        shape = (prompt_lens.shape[0], self.num_first_codes)
        ids = self.first_code_tokens.expand(shape).reshape(-1)
        return ids, prompt_lens[:, None].expand(shape).reshape(-1)

    def first_step(
        self, batch: LevelBatch, prefilled: Prefilled, beam_width: int, together: bool
    ) -> FirstStep:
        """Level 0 scores the prompts' last tokens; level 1's rows, where they ran in the
        prefill, become slot 0 of the first R * V0 beam rows.

        Raises:
            ValueError: ``together`` disagrees with whether the prefill ran level 1's rows.
        """
        if together != (prefilled.code_hidden is not None):
            raise ValueError("level 1's prefill rows must be given exactly when they ran")
        cfg, weight = self.model.config, self.model.lm_head.weight
        rows = batch.num_requests * beam_width
        if together:
            rows = max(rows, prefilled.code_hidden.shape[0])
        beam = BeamKV.allocate(
            cfg.num_layers, rows, max(self.num_levels - 1, 1), cfg.num_kv_heads, cfg.head_dim,
            weight.dtype, weight.device,
        )  # fmt: skip
        if not together:
            return FirstStep(((prefilled.last_hidden, 0),), beam, beam_width, 0)
        written = prefilled.code_hidden.shape[0]
        beam.k[:, :written, 0] = prefilled.code_kv.k[:, :, 0]  # in first-code order
        beam.v[:, :written, 0] = prefilled.code_kv.v[:, :, 0]
        beam.length = 1
        rows_scored = ((prefilled.last_hidden, 0), (prefilled.code_hidden, 1))
        # Level 1's parent p of request r is code row r * V0 + p.
        return FirstStep(rows_scored, beam, self.num_first_codes, 0)

    def forward_level(
        self, batch: LevelBatch, beam: BeamKV, ids: torch.Tensor, level: int, width: int
    ) -> torch.Tensor:
        num_requests = batch.num_requests
        pos = (batch.prompt_lens + level - 1)[:, None].expand(num_requests, width)
        live = beam.first_rows(num_requests * width)
        meta = DecodeMetadata(
            batch.shared, live, batch.prompt_offsets_host, width, self.attention_backend
        )
        return self.model(ids, pos.reshape(-1), meta)
