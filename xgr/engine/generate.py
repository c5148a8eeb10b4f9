"""The fixed-step generation of semantic IDs for a batch of prompts.

Steps, for R prompts, beam width B and L levels:

1. prefill: the packed prompts run once; each layer writes the shared KV; the last
   token of each prompt gives the first level's code log-probabilities;
2. level 0: constrained beam step from the trie root (one beam per request -> B beams);
3. levels 1..L-1: one decode forward for all R * B beams (each beam's last code as input,
   attention over the shared KV and its own KV), a constrained beam step, and the beams'
   ancestry index updated by their parents;
4. the surviving beams' trie nodes at depth L are the semantic IDs.

For an encoder-decoder (T5) the prefill is the encoder, which writes each decoder layer's
cross-attention K/V as the shared KV; level 0's log-probabilities come from one decoder step
over the decoder start token per request, whose self-attention K/V is slot 0 of the
request's first beam row, inherited by all its beams through the ancestry index. On CUDA the
encoder runs eagerly and the decode levels replay a CUDA graph, as for decoder-only models.

Everything from the start of prefill to the end of the last level runs on the device with
no host synchronization: the batch's host-built inputs go to the device in one copy before
any compute, scores are computed only for each level's codes (``xgr.beam.logits``), and the
only device-to-host transfer is the final (R, B) result. On CUDA, prefill and steps 2-4
replay CUDA graphs per batch shape (``xgr.engine.cuda_graph``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from xgr.beam import BeamState, constrained_beam_step
from xgr.beam.logits import code_log_probs, distinct_code_mask, level_head_weights
from xgr.catalog.trie import PrefixTrie
from xgr.kv import BeamKV, SharedKV
from xgr.layers.attention import DecodeMetadata, PrefillMetadata
from xgr.models.decoder import CausalLM
from xgr.models.t5 import EncDecDecodeMetadata, T5Seq2SeqLM

# Token id of a padded prefill's filler tokens (their results are never read).
PREFILL_PAD_TOKEN = 0


@dataclass
class GenerationOutput:
    """Semantic IDs found for a batch.

    Attributes:
        sid_index: (R, B) int64 row of ``ItemCatalog.semantic_ids`` per beam, best first.
        scores: (R, B) float32 summed log-probabilities; -inf where no valid path was left.
        prefill_ms: time of prefill (ms; device time on CUDA, from events).
        decode_ms: time of the selections and decode steps (ms; device time on CUDA).
    """

    sid_index: torch.Tensor
    scores: torch.Tensor
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


@dataclass
class BatchInputs:
    """A batch's inputs on the device, made from one host-to-device copy.

    Attributes:
        tokens: (T,) int64 packed prompt tokens.
        positions: (T,) int64 position of each token in its prompt.
        last_index: (R,) int64 packed index of each prompt's last token.
        prompt_lens: (R,) int64 prompt lengths (tokens).
        cu_seqlens: (R + 1,) int64 prompt offsets.
        cu_seqlens_int32: (R + 1,) int32 prompt offsets (packed flash attention).
        cu_seqlens_host: the same offsets as host ints.
        max_seqlen: the longest prompt (tokens).
    """

    tokens: torch.Tensor
    positions: torch.Tensor
    last_index: torch.Tensor
    prompt_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    cu_seqlens_int32: torch.Tensor
    cu_seqlens_host: list[int]
    max_seqlen: int

    @property
    def num_requests(self) -> int:
        return len(self.cu_seqlens_host) - 1

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens_host[-1]

    @property
    def seqlens(self) -> list[int]:
        cu = self.cu_seqlens_host
        return [b - a for a, b in zip(cu[:-1], cu[1:], strict=True)]


def prepare_inputs(prompts: list[list[int]], device: torch.device) -> BatchInputs:
    """Pack R non-empty token lists and copy them to ``device`` in one (async) transfer.

    Returns:
        The batch's inputs; on CUDA the copy is from pinned memory and does not block.
    """
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    cu = np.zeros(len(prompts) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    total, num = int(cu[-1]), len(prompts)
    host = np.empty(2 * total + 2 * num + num + 1, dtype=np.int64)
    host[:total] = np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts])
    host[total : 2 * total] = np.arange(total) - np.repeat(cu[:-1], lens)
    host[2 * total : 2 * total + num] = cu[1:] - 1
    host[2 * total + num : 2 * total + 2 * num] = lens
    host[2 * total + 2 * num :] = cu
    packed = torch.from_numpy(host)
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    else:
        packed = packed.to(device)
    tokens, positions, last, prompt_lens, cu_dev = torch.split(
        packed, [total, total, num, num, num + 1]
    )
    return BatchInputs(
        tokens,
        positions,
        last,
        prompt_lens,
        cu_dev,
        cu_dev.to(torch.int32),
        cu.tolist(),
        int(lens.max()),
    )


def prefill(model: CausalLM, inputs: BatchInputs, shared: SharedKV) -> torch.Tensor:
    """Run the packed prompts once, writing every layer's prompt KV into ``shared``.

    Returns:
        (R, hidden_size) final hidden state of each prompt's last token, model dtype.
    """
    meta = PrefillMetadata(
        shared, inputs.cu_seqlens_host, inputs.cu_seqlens_int32, inputs.max_seqlen
    )
    hidden = model(inputs.tokens, inputs.positions, meta)
    return hidden[inputs.last_index]


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


def allocate_shared_kv(model: CausalLM | T5Seq2SeqLM, inputs: BatchInputs) -> SharedKV:
    """Prompt KV buffers sized exactly for one batch (the eager path); for an
    encoder-decoder, the cross-attention K/V of its decoder layers."""
    layers, heads, head_dim = model.shared_kv_layout
    weight = model.lm_head.weight
    return SharedKV.allocate(
        layers, inputs.seqlens, heads, head_dim, weight.dtype, weight.device, inputs.cu_seqlens
    )


@torch.inference_mode()
def generate_semantic_ids(
    spec: DecodeSpec,
    prompts: list[list[int]],
    beam_width: int,
    top_k: int,
    graphs=None,
) -> GenerationOutput:
    """Constrained beam search over semantic IDs for a batch of tokenized prompts.

    Args:
        spec: model, trie and scoring (``DecodeSpec.build``).
        prompts: R non-empty lists of token ids (validated by the caller).
        beam_width: beams kept per request.
        top_k: candidates per beam per step.
        graphs: an ``xgr.engine.cuda_graph.CudaGraphs`` to replay prefill and the decode
            levels from CUDA graphs; None runs them eagerly.

    Returns:
        The best ``beam_width`` semantic IDs of each prompt with their scores, on the host.
    """
    device = spec.sid_token_ids.device
    if graphs is not None and device.type == "cuda":
        with graphs.lock:  # the pool and the graphs' outputs are reused by the next batch
            return _generate(spec, prompts, beam_width, top_k, graphs)
    return _generate(spec, prompts, beam_width, top_k, None)


def _generate(spec, prompts, beam_width, top_k, graphs) -> GenerationOutput:
    device = spec.sid_token_ids.device
    cuda = device.type == "cuda"
    if cuda:
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
    start = time.perf_counter()
    inputs = prepare_inputs(prompts, device)
    encdec = spec.model.is_encoder_decoder
    use_graph = graphs is not None and graphs.accepts(inputs.num_requests)
    last_hidden = None
    if use_graph and graphs.prefill_accepts(inputs):
        last_hidden = graphs.replay_prefill(inputs)
    else:
        shared = graphs.shared_kv(inputs) if use_graph else allocate_shared_kv(spec.model, inputs)
        if encdec:  # the encoder writes every decoder layer's cross-attention K/V
            spec.model.encode(inputs.tokens, inputs.cu_seqlens_host, shared)
        else:
            last_hidden = prefill(spec.model, inputs, shared)
    if cuda:
        events[1].record()
    prefilled = time.perf_counter()
    if use_graph:
        nodes, scores = graphs.replay_decode(spec, last_hidden, inputs, beam_width, top_k)
    elif encdec:
        nodes, scores = decode_levels_encdec(
            spec, shared, inputs.cu_seqlens_host, beam_width, top_k
        )
    else:
        nodes, scores = decode_levels(
            spec, last_hidden, inputs.prompt_lens, shared, inputs.cu_seqlens_host, beam_width, top_k
        )
    if cuda:
        events[2].record()
    nodes, scores = nodes.cpu(), scores.cpu()  # the one device-to-host copy
    done = time.perf_counter()
    if cuda:
        prefill_ms, decode_ms = events[0].elapsed_time(events[1]), events[1].elapsed_time(events[2])
    else:
        prefill_ms, decode_ms = (prefilled - start) * 1e3, (done - prefilled) * 1e3
    return GenerationOutput(nodes, scores, prefill_ms, decode_ms)
