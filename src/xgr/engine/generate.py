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
request's first beam row, inherited by all its beams through the ancestry index. Where the
beam holds every first-level code, that step and level 1's forward over all those codes run
as one pass (``xgr.engine.decode.runs_first_levels_together``). On CUDA the
encoder replays a CUDA graph of the prompts padded to one length per request slot
(``T5Seq2SeqLM.encode_padded``) and the decode levels another, as for decoder-only models.

Everything from the start of prefill to the end of the last level runs on the device with
no host synchronization: the batch's host-built inputs go to the device in one copy before
any compute, scores are computed only for each level's codes (``xgr.beam.logits``), and the
only device-to-host transfer is the final (R, B) result. On CUDA, prefill and steps 2-4
replay CUDA graphs per batch shape (``xgr.engine.cuda_graph``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from xgr.engine.decode import (
    decode_levels,
    decode_levels_encdec,
    level_one_inputs,
    level_one_kv,
    level_one_metadata,
    runs_first_levels_together,
)
from xgr.engine.inputs import BatchInputs, prepare_inputs
from xgr.engine.spec import DecodeSpec
from xgr.kv import BeamKV, SharedKV
from xgr.layers.attention import PrefillMetadata
from xgr.models.decoder import CausalLM
from xgr.models.t5 import T5Seq2SeqLM


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


def prefill(
    model: CausalLM, inputs: BatchInputs, shared: SharedKV, level_one: tuple | None = None
) -> torch.Tensor:
    """Run the packed prompts once, writing every layer's prompt KV into ``shared``.

    Args:
        level_one: None, or level 1's rows to run in the same pass
            (``xgr.engine.decode.runs_first_levels_together``): their (C,) int64 token ids
            and positions (``level_one_inputs``) and their ``DecodeMetadata``
            (``level_one_metadata``).

    Returns:
        (R + C, hidden_size) final hidden state of each prompt's last token, then of each
        of level 1's rows, model dtype.
    """
    tokens, positions, first_codes = inputs.tokens, inputs.positions, None
    if level_one is not None:
        ids, code_positions, first_codes = level_one
        tokens, positions = torch.cat((tokens, ids)), torch.cat((positions, code_positions))
    meta = PrefillMetadata(
        shared,
        inputs.cu_seqlens_host,
        inputs.cu_seqlens_int32,
        inputs.max_seqlen,
        output_rows=inputs.last_index,
        first_codes=first_codes,
    )
    return model(tokens, positions, meta)


def prefill_with_level_one(
    spec: DecodeSpec, inputs: BatchInputs, shared: SharedKV, kv: BeamKV
) -> tuple[torch.Tensor, tuple[torch.Tensor, BeamKV]]:
    """``prefill`` that also runs level 1's forward over every first-level code
    (``xgr.engine.decode.runs_first_levels_together``), its rows writing slot 0 of ``kv``
    (``level_one_kv``).

    Returns:
        last_hidden: (R, hidden_size) final hidden state of each prompt's last token.
        level_one: the (R * V0, hidden_size) hidden states of level 1's rows and ``kv``,
            as ``decode_levels`` takes them.
    """
    meta = level_one_metadata(spec, shared, kv, inputs.cu_seqlens_host)
    rows = (*level_one_inputs(spec, inputs.prompt_lens), meta)
    hidden = prefill(spec.model, inputs, shared, rows)
    num = inputs.num_requests
    return hidden[:num], (hidden[num:], kv)


def allocate_shared_kv(model: CausalLM | T5Seq2SeqLM, inputs: BatchInputs) -> SharedKV:
    """Prompt KV buffers sized exactly for one batch (the eager path); for an
    encoder-decoder, the cross-attention K/V of its decoder layers."""
    layers, heads, head_dim = model.shared_kv_layout
    weight = model.lm_head.weight
    return SharedKV.allocate(
        layers, inputs.seqlens, heads, head_dim, weight.dtype, weight.device, inputs.cu_seqlens,
        model.token_major_shared_kv,
    )  # fmt: skip


@dataclass
class PendingGeneration:
    """A batch whose device work is queued (``launch_semantic_ids``); ``wait`` returns it.

    On the CPU the work is already done and ``wait`` only hands the output over.
    """

    sid_index: torch.Tensor
    scores: torch.Tensor
    events: list | None = None  # CUDA: start, prefill done, decode done, results on the host
    host_ms: tuple[float, float] = (0.0, 0.0)
    device_index: int = 0  # CUDA: the device the events were recorded on
    _output: GenerationOutput | None = field(default=None, repr=False)
    _waiting: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def wait(self) -> GenerationOutput:
        """Block until the results are on the host (device time runs meanwhile); later
        calls, from any thread, return the same output. On CUDA the batch's events then go
        back to the pool (``_TimingEvents``), once."""
        with self._waiting:  # two threads must not both hand the events back
            if self._output is not None:
                return self._output
            if self.events is None:
                self._output = GenerationOutput(self.sid_index, self.scores, *self.host_ms)
                return self._output
            self.events[3].synchronize()
            start, prefilled, decoded = self.events[:3]
            self._output = GenerationOutput(
                self.sid_index,
                self.scores,
                start.elapsed_time(prefilled),
                prefilled.elapsed_time(decoded),
            )
            _TIMING_EVENTS.give(self.events, self.device_index)
            return self._output

    def done(self) -> bool:
        """Whether the device has finished the batch (its results are on the host)."""
        return self._output is not None or self.events is None or self.events[-1].query()


class _TimingEvents:
    """The four CUDA events of a batch, reused once a batch's timings are read: making a
    CUDA event (at its first record) took ~10 us of host time on the H200 machine, four a
    batch, against ~3 us to record one (``results/host-launch-ops-s13-*``). Keyed by
    device, since an event stays on the device it was first recorded on."""

    MAX_FREE = 64  # sets kept per device: more than the batches ever in flight at once

    def __init__(self) -> None:
        self._free: dict[int, list[list]] = {}
        self._lock = threading.Lock()

    def take(self, device_index: int) -> list:
        """Four events: start, prefill done, decode done (timing), results on the host."""
        with self._lock:
            free = self._free.get(device_index)
            if free:
                return free.pop()
        return [torch.cuda.Event(enable_timing=True) for _ in range(3)] + [torch.cuda.Event()]

    def give(self, events: list, device_index: int) -> None:
        """Return a batch's events once its timings are read; they are recorded again."""
        with self._lock:
            free = self._free.setdefault(device_index, [])
            if len(free) < self.MAX_FREE:
                free.append(events)


_TIMING_EVENTS = _TimingEvents()


def generate_semantic_ids(
    spec: DecodeSpec,
    prompts: Sequence[Sequence[int]],
    beam_width: int,
    top_k: int,
    graphs=None,
) -> GenerationOutput:
    """Constrained beam search over semantic IDs for a batch of tokenized prompts.

    Args:
        spec: model, trie and scoring (``DecodeSpec.build``).
        prompts: R non-empty token-id sequences (lists or int64 arrays; validated by the
            caller).
        beam_width: beams kept per request.
        top_k: candidates per beam per step.
        graphs: an ``xgr.engine.cuda_graph.CudaGraphs`` to replay prefill and the decode
            levels from CUDA graphs; None runs them eagerly.

    Returns:
        The best ``beam_width`` semantic IDs of each prompt with their scores, on the host.
    """
    return launch_semantic_ids(spec, prompts, beam_width, top_k, graphs).wait()


@torch.inference_mode()
def launch_semantic_ids(
    spec: DecodeSpec,
    prompts: Sequence[Sequence[int]],
    beam_width: int,
    top_k: int,
    graphs=None,
) -> PendingGeneration:
    """``generate_semantic_ids`` without waiting: on CUDA the batch's work, ending with the
    copy of its results into pinned host memory, is queued on the current stream and this
    returns at once, so the host can prepare and queue the next batch (stream order keeps
    the graphs' reused buffers safe: this batch's outputs are copied before the next batch's
    replays overwrite them). Arguments as ``generate_semantic_ids``.
    """
    device = spec.sid_token_ids.device
    if graphs is not None and device.type == "cuda":
        with graphs.lock:  # one launch at a time into the graphs' buffers
            return _launch(spec, prompts, beam_width, top_k, graphs)
    return _launch(spec, prompts, beam_width, top_k, None)


def _launch(spec, prompts, beam_width, top_k, graphs) -> PendingGeneration:
    device = spec.sid_token_ids.device
    cuda = device.type == "cuda"
    if cuda:
        # The events are recorded on the current stream: key the pool by its device.
        index = torch.cuda.current_device()
        events = _TIMING_EVENTS.take(index)
        events[0].record()
    start = time.perf_counter()
    encdec = spec.model.is_encoder_decoder
    use_graph = graphs is not None and graphs.accepts(len(prompts))
    # Level 1 within a decoder-only prefill (an encoder-decoder decides in its decode).
    with_level_one = not encdec and runs_first_levels_together(spec, len(prompts), beam_width)
    level_one = None
    # A graphed prefill's inputs go straight to where its graph reads them.
    inputs = graphs.stage(prompts, with_level_one) if use_graph else None
    last_hidden = None
    if inputs is not None:
        last_hidden, level_one = graphs.replay_prefill(inputs, spec if with_level_one else None)
    else:
        inputs = prepare_inputs(prompts, device)
        shared = graphs.shared_kv(inputs) if use_graph else allocate_shared_kv(spec.model, inputs)
        if encdec:  # the encoder writes every decoder layer's cross-attention K/V
            spec.model.encode(inputs.tokens, inputs.cu_seqlens_host, shared)
        elif with_level_one:  # a graphed decode reads the graphs' own level-1 K/V
            kv = graphs.level_one_kv(spec) if use_graph else level_one_kv(spec, 1)
            last_hidden, level_one = prefill_with_level_one(spec, inputs, shared, kv)
        else:
            last_hidden = prefill(spec.model, inputs, shared)
    if cuda:
        events[1].record()
    prefilled = time.perf_counter()
    if use_graph:
        nodes, scores = graphs.replay_decode(
            spec, last_hidden, inputs, beam_width, top_k, level_one
        )
    elif encdec:
        nodes, scores = decode_levels_encdec(
            spec, shared, inputs.cu_seqlens_host, beam_width, top_k
        )
    else:
        nodes, scores = decode_levels(
            spec, last_hidden, inputs.prompt_lens, shared, inputs.cu_seqlens_host, beam_width,
            top_k, level_one,
        )  # fmt: skip
    if not cuda:
        done = time.perf_counter()
        host_ms = ((prefilled - start) * 1e3, (done - prefilled) * 1e3)
        return PendingGeneration(nodes, scores, host_ms=host_ms)
    events[2].record()
    # The one device-to-host copy, into pinned memory so that it is queued, not waited for.
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in (nodes, scores)]
    for dst, src in zip(host, (nodes, scores), strict=True):
        dst.copy_(src, non_blocking=True)
    events[3].record()
    return PendingGeneration(host[0], host[1], events, device_index=index)
