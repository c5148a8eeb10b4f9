"""The runner of T5-family encoder-decoders (TIGER, OneRec): the encoder writes every decoder
layer's cross-attention K/V once, then one decoder step a level over the live beams."""

from __future__ import annotations

import torch

from xgr.kv import BeamKV
from xgr.models.t5 import EncDecDecodeMetadata
from xgr.runner.base import FamilyRunner, FirstStep, LevelBatch, PrefillBatch, Prefilled
from xgr.runner.shapes import PrefillShape, slotted_shape


class EncoderDecoderRunner(FamilyRunner):
    """``ModelRunner`` of a ``T5Seq2SeqLM``.

    Level 0 scores one decoder step over the decoder start token per request, whose
    self-attention K/V is slot 0 of the request's first beam row, inherited by all its
    beams through the ancestry index. Where the beam holds every first-level code, level 0
    keeps them all whatever their scores, so the start step and level 1's step over those
    codes run as one pass (``T5Seq2SeqLM.decode_start_and_codes``), any number of requests.

    Args: as ``FamilyRunner``'s, ``model`` a ``T5Seq2SeqLM``.
    """

    # What bounds a prompt, for error messages.
    prompt_limit = "config.json's n_positions, or xgr's default for T5"

    @property
    def max_prompt_tokens(self) -> int:
        """The config's ``max_prompt_tokens`` (the decoder has positions of its own)."""
        return self.model.config.max_prompt_tokens

    def first_levels_together(self, num_requests: int, beam_width: int) -> bool:
        return self._beam_holds_first_codes(beam_width)

    def prefill_shape(
        self, prompt_lens: list[int], max_requests: int, together: bool
    ) -> PrefillShape:
        """Prompt slots padded to one length (``slotted_shape``); level 1 never joins the
        encoder, so ``together`` changes nothing."""
        weight = self.model.lm_head.weight
        per_square_token = 0
        if self.model.encoder_builds_mask(weight.device):
            per_square_token = self.model.config.num_heads * weight.element_size()
        return slotted_shape(prompt_lens, max_requests, per_square_token)

    def allocate_code_kv(self, num_requests: int) -> None:
        """None: level 1's rows run in the decoder's first step, never in the encoder."""
        return None

    def prefill(self, batch: PrefillBatch) -> Prefilled:
        """The encoder over the prompts, writing each decoder layer's cross-attention K/V
        into ``batch.shared``: packed, or (a graph) each prompt padded to its slot."""
        model = self.model
        if batch.slot_tokens:
            model.encode_padded(
                batch.tokens, batch.prompt_lens, batch.slot_tokens, batch.shared, batch.embeds
            )
        else:
            model.encode(batch.tokens, batch.prompt_offsets_host, batch.shared, batch.embeds)
        return Prefilled()

    def first_step(
        self, batch: LevelBatch, prefilled: Prefilled, beam_width: int, together: bool
    ) -> FirstStep:
        if together:
            return self._start_and_codes(batch, beam_width)
        model = self.model
        num_requests = batch.num_requests
        device = batch.prompt_lens.device
        # Slots: the decoder start token, then the codes of levels 0..L-2 (the last level's
        # code is chosen, never fed back).
        beam = model.allocate_beam_kv(num_requests * beam_width, self.num_levels)
        first_rows = torch.arange(num_requests, device=device) * beam_width
        start = torch.full(
            (num_requests,), model.config.decoder_start_token_id, dtype=torch.int64,
            device=device,
        )  # fmt: skip
        # One row per request: the start token's K/V goes to the request's first beam row,
        # and the reorder after level 0 points every beam of the request at it.
        meta = EncDecDecodeMetadata(
            batch.shared, beam, batch.prompt_offsets_host, 1, first_rows, self.attention_backend
        )
        hidden = model.decode(start, meta)
        beam.length = 1
        return FirstStep(((hidden, 0),), beam, beam_width, 0)

    def _start_and_codes(self, batch: LevelBatch, beam_width: int) -> FirstStep:
        """The start step and level 1's step in one pass. Its rows are request-major,
        1 + V0 a request: the start token, then each first-level code, whose K/V stay at
        those rows (slots 0 and 1)."""
        model, codes = self.model, self.first_code_tokens
        device = batch.prompt_lens.device
        num_requests, num_codes = batch.num_requests, codes.shape[0]
        per_request = 1 + num_codes
        rows = num_requests * per_request
        beam = model.allocate_beam_kv(num_requests * max(beam_width, per_request), self.num_levels)
        pass_rows = torch.arange(rows, device=device)
        # Every code row's slot 0 is its request's start token.
        beam.rows[:rows, 0] = (pass_rows - pass_rows % per_request).to(beam.rows.dtype)
        ids = torch.empty(num_requests, per_request, dtype=torch.int64, device=device)
        ids[:, 0] = model.config.decoder_start_token_id
        ids[:, 1:] = codes
        meta = EncDecDecodeMetadata(
            batch.shared, beam, batch.prompt_offsets_host, per_request, pass_rows,
            self.attention_backend,
        )  # fmt: skip
        hidden = model.decode_start_and_codes(ids.reshape(-1), meta)
        hidden = hidden.view(num_requests, per_request, -1)
        beam.length = 2
        scored = ((hidden[:, 0], 0), (hidden[:, 1:].reshape(num_requests * num_codes, -1), 1))
        # Level 1's parent p of request r continues pass row r * (1 + V0) + 1 + p.
        return FirstStep(scored, beam, per_request, 1)

    def forward_level(
        self, batch: LevelBatch, beam: BeamKV, ids: torch.Tensor, level: int, width: int
    ) -> torch.Tensor:
        rows = torch.arange(batch.num_requests * width, device=ids.device)
        meta = EncDecDecodeMetadata(
            batch.shared, beam, batch.prompt_offsets_host, width, rows, self.attention_backend
        )
        return self.model.decode(ids, meta)
