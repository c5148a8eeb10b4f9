"""The decode levels of a prefilled batch: every level's constrained selection and the
decode forward between levels, for decoder-only and encoder-decoder models (steps 2-4 of
``xgr.engine.generate``). No host synchronization: CUDA graphs capture these whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.beam import BeamState, constrained_beam_step
from xgr.beam.logits import code_log_probs, distinct_code_mask, level_head_weights
from xgr.catalog.trie import PrefixTrie
from xgr.kv import BeamKV, SharedKV
from xgr.layers.attention import DecodeMetadata
from xgr.models.decoder import CausalLM
from xgr.models.t5 import EncDecDecodeMetadata, T5Seq2SeqLM


@dataclass
class DecodeSpec:
    """What the decode levels need besides the batch: model, catalog and scoring.

    Attributes:
        model: the decoder-only LM or the T5 encoder-decoder.
        trie: the catalog's valid-path trie, on the model's device.
        sid_token_ids: (num_levels, codebook_size) int64 vocabulary id of each code.
        level_weights: (num_levels, codebook_size, hidden) float32 LM-head rows of each
            level's codes.
        code_mask: (num_levels, codebook_size) bool, True for the codes that are distinct
            in-vocabulary tokens: the set each level's scores are normalized over when
            ``full_vocab`` is False, and whose float32 logits replace their rounded ones in
            the full-vocabulary normalizer.
        full_vocab: normalize scores over the whole vocabulary (exact log-probabilities);
            False normalizes over each level's codes (vocabularies of codes only).
        attention_backend: "torch" (reference) or "triton" (GPU kernel) decode attention.
    """

    model: CausalLM | T5Seq2SeqLM
    trie: PrefixTrie
    sid_token_ids: torch.Tensor
    level_weights: torch.Tensor
    code_mask: torch.Tensor
    full_vocab: bool = True
    attention_backend: str = "torch"

    @classmethod
    def build(
        cls,
        model: CausalLM | T5Seq2SeqLM,
        trie: PrefixTrie,
        sid_token_ids: torch.Tensor,
        full_vocab: bool = True,
        attention_backend: str = "torch",
    ) -> DecodeSpec:
        weights = level_head_weights(model.lm_head.weight.detach(), sid_token_ids)
        mask = distinct_code_mask(sid_token_ids, model.config.vocab_size)
        return cls(model, trie, sid_token_ids, weights, mask, full_vocab, attention_backend)

    def log_probs(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """(N, hidden) -> (N, codebook_size) float32 log-probabilities of the level's codes."""
        full = self.model.lm_head.weight if self.full_vocab else None
        return code_log_probs(hidden, self.level_weights[level], full, self.code_mask[level])


def decode_levels(
    spec: DecodeSpec,
    last_hidden: torch.Tensor,
    prompt_lens: torch.Tensor,
    shared: SharedKV,
    cu_seqlens_host: list[int],
    beam_width: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every level's selection and decode forward for a prefilled batch (no host sync).

    Args:
        spec: model, trie and scoring.
        last_hidden: (R, hidden) prefill output at each prompt's last token.
        prompt_lens: (R,) int64 prompt lengths on the device.
        shared: the batch's prompt KV (filled by prefill).
        cu_seqlens_host: R + 1 prompt offsets (read by the torch reference attention only).
        beam_width, top_k: search parameters.

    Returns:
        nodes: (R, beam_width) int64 semantic-ID row of each final beam, best first.
        scores: (R, beam_width) float32 summed log-probabilities (-inf: no valid path).
    """
    cfg = spec.model.config
    num_requests, num_levels = last_hidden.shape[0], len(spec.trie.levels)
    beam = BeamKV.allocate(
        cfg.num_layers,
        num_requests * beam_width,
        max(num_levels - 1, 1),
        cfg.num_kv_heads,
        cfg.head_dim,
        last_hidden.dtype,
        last_hidden.device,
    )
    meta = DecodeMetadata(shared, beam, cu_seqlens_host, beam_width, spec.attention_backend)

    def forward(ids: torch.Tensor, level: int) -> torch.Tensor:
        pos = (prompt_lens + level - 1)[:, None].expand(num_requests, beam_width)
        return spec.model(ids, pos.reshape(-1), meta)

    first = spec.log_probs(last_hidden, 0)
    return _search_levels(spec, first, beam, forward, beam_width, top_k)


def decode_levels_encdec(
    spec: DecodeSpec,
    shared: SharedKV,
    cu_seqlens_host: list[int],
    beam_width: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_levels`` of an encoder-decoder: the decoder start step, then every level.

    Args:
        spec: a ``T5Seq2SeqLM`` with its trie and scoring.
        shared: the batch's cross-attention K/V (filled by ``T5Seq2SeqLM.encode``).
        cu_seqlens_host: R + 1 prompt offsets.
        beam_width, top_k: search parameters.

    Returns:
        nodes, scores: as ``decode_levels``.
    """
    model = spec.model
    device = shared.k.device
    num_requests, num_levels = len(cu_seqlens_host) - 1, len(spec.trie.levels)
    # Slots: the decoder start token, then the codes of levels 0..L-2 (the last level's code
    # is chosen, never fed back).
    beam = model.allocate_beam_kv(num_requests * beam_width, num_levels)
    first_rows = torch.arange(num_requests, device=device) * beam_width
    start = torch.full(
        (num_requests,), model.config.decoder_start_token_id, dtype=torch.int64, device=device
    )
    # One row per request: the start token's K/V goes to the request's first beam row, and
    # the reorder after level 0 points every beam of the request at it (all have parent 0).
    backend = spec.attention_backend
    meta = EncDecDecodeMetadata(shared, beam, cu_seqlens_host, 1, first_rows, backend)
    hidden = model.decode(start, meta)
    beam.length = 1
    all_rows = torch.arange(num_requests * beam_width, device=device)
    meta = EncDecDecodeMetadata(shared, beam, cu_seqlens_host, beam_width, all_rows, backend)
    first = spec.log_probs(hidden, 0)
    return _search_levels(
        spec, first, beam, lambda ids, _level: model.decode(ids, meta), beam_width, top_k
    )


def _search_levels(
    spec: DecodeSpec,
    first_log_probs: torch.Tensor,
    beam: BeamKV,
    forward,
    beam_width: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The constrained selections of all levels around one decode forward per later level.

    Args:
        spec: trie, code map and scoring.
        first_log_probs: (R, codebook_size) float32 level-0 code log-probabilities.
        beam: the beams' KV, (R * beam_width) rows; its written slots (none at level 0 for
            a decoder-only model, the start token for an encoder-decoder) follow the beams.
        forward: ``forward(ids, level)`` runs the model over (R * beam_width,) int64 token
            ids (each beam's previous code) and returns (R * beam_width, hidden) head inputs.
        beam_width, top_k: search parameters.

    Returns:
        nodes, scores: (R, beam_width) as ``decode_levels``.
    """
    vocab = spec.model.config.vocab_size
    num_requests, num_levels = first_log_probs.shape[0], len(spec.trie.levels)
    device = first_log_probs.device
    # The root is every beam's common parent: it alone supplies the first beam_width beams.
    state = constrained_beam_step(
        BeamState.root(num_requests, device),
        first_log_probs[:, None, :],
        spec.trie.levels[0],
        None,
        beam_width,
        max(top_k, beam_width),
    )
    row_base = torch.arange(num_requests, device=device)[:, None] * beam_width
    for level in range(1, num_levels):
        if beam.length:  # each beam inherits its parent's written slots
            beam.reorder((state.parents + row_base).reshape(-1))
        ids = spec.sid_token_ids[level - 1][state.codes].clamp(0, vocab - 1)
        hidden = forward(ids.reshape(-1), level)
        beam.length += 1
        log_probs = spec.log_probs(hidden, level).view(num_requests, beam_width, -1)
        state = constrained_beam_step(
            state, log_probs, spec.trie.levels[level], None, beam_width, top_k
        )
    return state.nodes, state.scores
