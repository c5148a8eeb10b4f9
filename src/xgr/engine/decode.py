"""The decode levels of a prefilled batch: every level's constrained selection and the
decode forward between levels, for decoder-only and encoder-decoder models (steps 2-4 of
``xgr.engine.generate``). No host synchronization: CUDA graphs capture these whole.
"""

from __future__ import annotations

import torch

from xgr.beam import BeamState, constrained_beam_step
from xgr.catalog.trie import PrefixTrie
from xgr.engine.spec import DecodeSpec
from xgr.kv import BeamKV, SharedKV
from xgr.layers.attention import DecodeMetadata
from xgr.models.t5 import EncDecDecodeMetadata

# Run level 1's forward in the pass before it where the beam holds every first-level code
# (``runs_first_levels_together``).
FIRST_LEVELS_TOGETHER = True


def decode_levels(
    spec: DecodeSpec,
    last_hidden: torch.Tensor,
    prompt_lens: torch.Tensor,
    shared: SharedKV,
    cu_seqlens_host: list[int],
    beam_width: int,
    top_k: int,
    level_one: tuple[torch.Tensor, BeamKV] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every level's selection and decode forward for a prefilled batch (no host sync).

    Args:
        spec: model, trie and scoring.
        last_hidden: (R, hidden) prefill output at each prompt's last token.
        prompt_lens: (R,) int64 prompt lengths on the device.
        shared: the batch's prompt KV (filled by prefill).
        cu_seqlens_host: R + 1 prompt offsets (read by the torch reference attention only).
        beam_width, top_k: search parameters.
        level_one: None, or level 1's forward run within the prefill
            (``runs_first_levels_together``): the (R * V0, hidden) hidden states of its
            rows (``level_one_inputs``) and the one-slot ``level_one_kv`` they wrote.

    Returns:
        nodes: (R, beam_width) int64 semantic-ID row of each final beam, best first.
        scores: (R, beam_width) float32 summed log-probabilities (-inf: no valid path).
    """
    cfg = spec.model.config
    num_requests, num_levels = last_hidden.shape[0], len(spec.trie.levels)
    rows = num_requests * beam_width
    if level_one is not None:
        rows = max(rows, level_one[0].shape[0])
    beam = BeamKV.allocate(
        cfg.num_layers, rows, max(num_levels - 1, 1), cfg.num_kv_heads, cfg.head_dim,
        last_hidden.dtype, last_hidden.device,
    )  # fmt: skip

    def forward(ids: torch.Tensor, level: int, width: int) -> torch.Tensor:
        pos = (prompt_lens + level - 1)[:, None].expand(num_requests, width)
        live_beams = beam.first_rows(num_requests * width)
        meta = DecodeMetadata(shared, live_beams, cu_seqlens_host, width, spec.attention_backend)
        return spec.model(ids, pos.reshape(-1), meta)

    if level_one is None:
        first = spec.log_probs(last_hidden, 0)
        return _search_levels(spec, first, beam, forward, beam_width, top_k)
    hidden, kv = level_one
    written = hidden.shape[0]
    beam.k[:, :written, 0] = kv.k[:, :, 0]  # slot 0 of the code rows, in their order
    beam.v[:, :written, 0] = kv.v[:, :, 0]
    beam.length = 1
    first, second = spec.log_probs_of_levels([(last_hidden, 0), (hidden, 1)])
    state = _level_one_step(spec, first, second, beam_width, top_k)
    widths = live_beam_widths(spec.trie, beam_width, top_k)[1:]
    layout = (spec.first_codes.shape[0], 0)  # level 1's parent p of request r: row r * V0 + p
    return _later_levels(spec, state, beam, forward, beam_width, top_k, widths, layout)


def level_one_inputs(spec: DecodeSpec, prompt_lens: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Token ids and positions of the rows that run level 1's forward within a decoder-only
    prefill: every first-level code of each request, at the position after its prompt.

    Args:
        spec: the model's ``DecodeSpec`` (``first_codes``).
        prompt_lens: (R,) int64 prompt lengths on the device.

    Returns:
        ids, positions: (R * V0,) int64 each, request-major, codes in ``first_codes`` order.
    """
    num_requests, num_codes = prompt_lens.shape[0], spec.first_codes.shape[0]
    vocab = spec.model.config.vocab_size
    ids = spec.sid_token_ids[0][spec.first_codes].clamp(0, vocab - 1)
    shape = (num_requests, num_codes)
    return ids.expand(shape).reshape(-1), prompt_lens[:, None].expand(shape).reshape(-1)


def level_one_kv(spec: DecodeSpec, num_requests: int) -> BeamKV:
    """The one-slot ``BeamKV`` that level 1's rows of a prefill write: R * V0 rows."""
    cfg, weight = spec.model.config, spec.model.lm_head.weight
    rows = num_requests * spec.first_codes.shape[0]
    return BeamKV.allocate(
        cfg.num_layers, rows, 1, cfg.num_kv_heads, cfg.head_dim, weight.dtype, weight.device
    )


def level_one_metadata(
    spec: DecodeSpec, shared: SharedKV, kv: BeamKV, cu_seqlens_host: list[int]
) -> DecodeMetadata:
    """The ``PrefillMetadata.first_codes`` of level 1's rows in a prefill: V0 rows a
    request writing slot 0 of ``kv`` (``level_one_kv``) and attending over ``shared`` (its
    ``cu_seqlens``: (R + 1,) prompt offsets on the device)."""
    width = spec.first_codes.shape[0]
    return DecodeMetadata(shared, kv, cu_seqlens_host, width, spec.attention_backend)


def _level_one_step(
    spec: DecodeSpec, first: torch.Tensor, second: torch.Tensor, beam_width: int, top_k: int
) -> BeamState:
    """Level 1's selection when level 0 kept every first-level code: level 0's beams are
    the V0 codes in ``first_codes`` order with their scores, and level 1's candidates are
    read from the rows that ran all of them.

    Args:
        first: (R, codebook_size) float32 level-0 code log-probabilities.
        second: (R * V0, codebook_size) float32 level-1 code log-probabilities of each
            request's code rows, request-major.
    """
    codes = spec.first_codes
    num_requests, num_codes = first.shape[0], codes.shape[0]
    shape = (num_requests, num_codes)
    zeros = torch.zeros(shape, dtype=torch.int64, device=first.device)
    level_0 = BeamState(first[:, codes], spec.first_nodes.expand(shape), codes.expand(shape), zeros)
    return constrained_beam_step(
        level_0, second.view(num_requests, num_codes, -1), spec.trie.levels[1], None,
        beam_width, top_k,
    )  # fmt: skip


def decode_levels_encdec(
    spec: DecodeSpec,
    shared: SharedKV,
    cu_seqlens_host: list[int],
    beam_width: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_levels`` of an encoder-decoder: the decoder start step, then every level
    (the start step and level 1's forward in one pass where ``runs_first_levels_together``).

    Args:
        spec: a ``T5Seq2SeqLM`` with its trie and scoring.
        shared: the batch's cross-attention K/V (filled by ``T5Seq2SeqLM.encode``).
        cu_seqlens_host: R + 1 prompt offsets.
        beam_width, top_k: search parameters.

    Returns:
        nodes, scores: as ``decode_levels``.
    """
    if runs_first_levels_together(spec, len(cu_seqlens_host) - 1, beam_width):
        return _decode_encdec_start_and_codes(spec, shared, cu_seqlens_host, beam_width, top_k)
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
    first = spec.log_probs(hidden, 0)
    forward = _encdec_forward(spec, shared, beam, cu_seqlens_host)
    return _search_levels(spec, first, beam, forward, beam_width, top_k)


def _encdec_forward(spec: DecodeSpec, shared: SharedKV, beam: BeamKV, cu_seqlens_host: list[int]):
    """The ``forward(ids, level, width)`` of an encoder-decoder's later levels: one decoder
    step over the first ``width`` beams of each request, rows r * width + b."""
    num_requests = len(cu_seqlens_host) - 1

    def forward(ids: torch.Tensor, _level: int, width: int) -> torch.Tensor:
        rows = torch.arange(num_requests * width, device=shared.k.device)
        meta = EncDecDecodeMetadata(
            shared, beam, cu_seqlens_host, width, rows, spec.attention_backend
        )
        return spec.model.decode(ids, meta)

    return forward


def runs_first_levels_together(spec: DecodeSpec, num_requests: int, beam_width: int) -> bool:
    """Whether level 1's forward runs in the same pass as the step before it: an
    encoder-decoder's decoder start step (``T5Seq2SeqLM.decode_start_and_codes``), or the
    prefill of a decoder-only model's single request (``PrefillMetadata.first_codes``).

    Level 1's forward takes the codes that level 0 keeps as input. When the beam holds
    every first-level code of the catalog (V0 <= beam width), level 0 keeps them all,
    whatever their scores: the forward can run on all of them before their scores are
    known, and one pass over the weights replaces two. Its V0 rows a request are those
    level 1 would run anyway. Batches of several requests of a decoder-only model keep
    the steps apart: the packed prefill graphs pad to a fixed number of request slots,
    whose code rows would follow the padding. ``FIRST_LEVELS_TOGETHER`` False turns both
    off.

    The results are those of the steps one after the other, with two differences that
    change no outcome: a code whose level-0 score is NaN is dropped at level 1's selection
    instead of level 0's, and candidates of exactly equal scores may come out in another
    order (level 1's pool lists the codes in ``first_codes`` order, not by level-0 score).
    """
    return (
        FIRST_LEVELS_TOGETHER
        and (spec.model.is_encoder_decoder or num_requests == 1)
        and spec.first_codes is not None
        and len(spec.trie.levels) >= 2
        and spec.first_codes.shape[0] <= beam_width
    )


def _decode_encdec_start_and_codes(
    spec: DecodeSpec,
    shared: SharedKV,
    cu_seqlens_host: list[int],
    beam_width: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``decode_levels_encdec`` with the start step and level 1's forward in one pass
    (``runs_first_levels_together``); same arguments and result.

    The pass's rows are request-major, 1 + V0 a request: the start token, then each
    first-level code in ``spec.first_codes`` order, whose K/V stay at those rows (slots 0
    and 1). Level 0's beams are those codes with their scores, in that order; level 1's
    selection then reads the pass's log-probabilities directly, and its beams' parents
    are rows of the pass.
    """
    model, codes = spec.model, spec.first_codes
    device = shared.k.device
    num_requests, num_levels = len(cu_seqlens_host) - 1, len(spec.trie.levels)
    num_codes = codes.shape[0]
    per_request = 1 + num_codes
    rows = num_requests * per_request
    beam = model.allocate_beam_kv(num_requests * max(beam_width, per_request), num_levels)
    pass_rows = torch.arange(rows, device=device)
    # Every code row's slot 0 is its request's start token.
    beam.rows[:rows, 0] = (pass_rows - pass_rows % per_request).to(beam.rows.dtype)
    ids = torch.empty(num_requests, per_request, dtype=torch.int64, device=device)
    ids[:, 0] = model.config.decoder_start_token_id
    ids[:, 1:] = spec.sid_token_ids[0][codes]
    backend = spec.attention_backend
    meta = EncDecDecodeMetadata(shared, beam, cu_seqlens_host, per_request, pass_rows, backend)
    hidden = model.decode_start_and_codes(ids.reshape(-1), meta).view(num_requests, per_request, -1)
    beam.length = 2
    first, second = spec.log_probs_of_levels(
        [(hidden[:, 0], 0), (hidden[:, 1:].reshape(num_requests * num_codes, -1), 1)]
    )  # [R, codebook], [R * V0, codebook]
    state = _level_one_step(spec, first, second, beam_width, top_k)
    forward = _encdec_forward(spec, shared, beam, cu_seqlens_host)
    widths = live_beam_widths(spec.trie, beam_width, top_k)[1:]
    # Level 1's beams continue rows r * (1 + V0) + 1 + parent of the pass.
    layout = (per_request, 1)
    return _later_levels(spec, state, beam, forward, beam_width, top_k, widths, layout)


def live_beam_widths(trie: PrefixTrie, beam_width: int, top_k: int) -> list[int]:
    """Beams per request that can hold a valid prefix when each later level's forward runs.

    A level's selection keeps at most ``beam_width`` beams, at most ``top_k`` per parent
    (all of a node's children where ``top_k`` is wider), and never more than the catalog's
    distinct prefixes of that length; the beams beyond are dead (score -inf) and sorted last
    (``constrained_beam_step``). The forward of level ``l`` therefore runs on the first
    ``widths[l - 1]`` beams of each request only: with 256 first-level codes and a beam of
    512, level 1's forward (and its LM head) runs on half the rows. The bound depends on
    the catalog and the search parameters alone, so the shapes stay fixed (CUDA graphs).

    Args:
        trie: the catalog's trie.
        beam_width, top_k: search parameters.

    Returns:
        widths[l - 1] for levels l = 1 .. num_levels - 1, each in [1, beam_width].
    """
    levels = trie.levels
    # The root is the first step's only parent and offers all of its children.
    live = min(beam_width, levels[0].num_children)
    widths = []
    for level in levels[1:]:
        widths.append(max(live, 1))
        live = min(beam_width, level.num_children, live * min(top_k, level.width))
    return widths


def _search_levels(
    spec: DecodeSpec,
    first_log_probs: torch.Tensor,
    beam: BeamKV,
    forward,
    beam_width: int,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The constrained selections of all levels around one decode forward per later level.

    Level l's forward runs on the first ``live_beam_widths(...)[l - 1]`` beams of each
    request (W rows a request, request-major: rows r * W .. r * W + W - 1); the beams after
    them are dead and skip it. Each forward writes its slot at those compact rows, so the
    reorder before the next level points each beam at its parent's row in the previous
    level's layout.

    Args:
        spec: trie, code map and scoring.
        first_log_probs: (R, codebook_size) float32 level-0 code log-probabilities.
        beam: the beams' KV, (R * beam_width) rows; its written slots (none at level 0 for
            a decoder-only model, the start token at each request's row r * beam_width for
            an encoder-decoder) follow the beams.
        forward: ``forward(ids, level, width)`` runs the model over (R * width,) int64 token
            ids (the previous code of each request's first ``width`` beams) and returns
            (R * width, hidden) head inputs.
        beam_width, top_k: search parameters.

    Returns:
        nodes, scores: (R, beam_width) as ``decode_levels``.
    """
    num_requests = first_log_probs.shape[0]
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
    widths = live_beam_widths(spec.trie, beam_width, top_k)
    return _later_levels(spec, state, beam, forward, beam_width, top_k, widths, (beam_width, 0))


def _later_levels(
    spec: DecodeSpec,
    state: BeamState,
    beam: BeamKV,
    forward,
    beam_width: int,
    top_k: int,
    widths: list[int],
    layout: tuple[int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The levels after ``state``'s: one forward and selection each, as ``_search_levels``.

    Args:
        state: (R, B') beams after level ``L - 1 - len(widths)``.
        widths: beams a request each later level's forward runs on.
        layout: (stride, offset): the beam row whose written slots beam p of request r
            continues is r * stride + offset + p (the last forward's rows).
        Others: as ``_search_levels``.
    """
    vocab = spec.model.config.vocab_size
    num_levels = len(spec.trie.levels)
    num_requests = state.scores.shape[0]
    requests = torch.arange(num_requests, device=state.scores.device)[:, None]
    stride, offset = layout
    for level, width in zip(range(num_levels - len(widths), num_levels), widths, strict=True):
        live = state.narrow(width)
        if beam.length:  # each beam inherits its parent's written slots
            beam.reorder((live.parents + requests * stride + offset).reshape(-1))
        ids = spec.sid_token_ids[level - 1][live.codes].clamp(0, vocab - 1)
        hidden = forward(ids.reshape(-1), level, width)
        beam.length += 1
        log_probs = spec.log_probs(hidden, level).view(num_requests, width, -1)
        state = constrained_beam_step(
            live, log_probs, spec.trie.levels[level], None, beam_width, top_k
        )
        stride, offset = width, 0
    return state.nodes, state.scores
