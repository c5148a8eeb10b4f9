"""The fixed-step generation of semantic IDs for a batch of prompts.

Steps, for R prompts, beam width B and L levels:

1. prefill (``ModelRunner.prefill``): the packed prompts run once and write the shared KV
   (for an encoder-decoder, the encoder writes each decoder layer's cross-attention K/V);
2. the search (``xgr.engine.search``): the runner's first step gives level 0's rows (and
   level 1's, where its forward ran in the pass before), then each later level one decode
   forward for the live beams, a constrained beam step and the beams' ancestry updated;
3. the surviving beams' trie nodes at depth L are the semantic IDs.

Everything from the start of prefill to the end of the last level runs on the device with
no host synchronization: the batch's host-built inputs go to the device in one copy before
any compute, scores are computed only for each level's codes (``xgr.beam.scoring``), and
the only device-to-host transfer is the final beams (nodes, scores, level scores). On
CUDA, prefill and the search replay CUDA graphs (``xgr.engine.cuda_graph``), as
``CudaGraphs.plan`` decides.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.graph_keys import EAGER, GraphPlan
from xgr.engine.inputs import BatchInputs, Spans, prepare_inputs
from xgr.engine.search import search_levels
from xgr.engine.spec import DecodeSpec
from xgr.kv import SharedKV
from xgr.runner import LevelBatch


@dataclass
class GenerationOutput:
    """Semantic IDs found for a batch.

    Attributes:
        sid_index: (R, B) int64 row of ``ItemCatalog.semantic_ids`` per beam, best first.
        scores: (R, B) float32 summed log-probabilities; -inf where no valid path was left.
        level_scores: (R, B, L) float32 log-probability of each level's code (summed in
            level order they give ``scores``).
        prefill_ms: time of prefill (ms; device time on CUDA, from events).
        decode_ms: time of the selections and decode steps (ms; device time on CUDA).
    """

    sid_index: torch.Tensor
    scores: torch.Tensor
    level_scores: torch.Tensor
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


def allocate_shared_kv(model: torch.nn.Module, inputs: BatchInputs) -> SharedKV:
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
    level_scores: torch.Tensor
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
                self._output = GenerationOutput(
                    self.sid_index, self.scores, self.level_scores, *self.host_ms
                )
                return self._output
            self.events[3].synchronize()
            start, prefilled, decoded = self.events[:3]
            self._output = GenerationOutput(
                self.sid_index,
                self.scores,
                self.level_scores,
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
    CUDA event (at its first record) costs several times the host time of recording one.
    Keyed by device, since an event stays on the device it was first recorded on."""

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
    graphs: CudaGraphs | None = None,
) -> GenerationOutput:
    """Constrained beam search over semantic IDs for a batch of tokenized prompts.

    Args:
        spec: runner, scorer and trie (``DecodeSpec.build``).
        prompts: R non-empty token-id sequences (lists or int64 arrays; validated by the
            caller).
        beam_width: beams kept per request.
        top_k: candidates per beam per step.
        graphs: the ``CudaGraphs`` to replay prefill and the search from, as their
            ``plan`` decides; None runs them eagerly.

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
    graphs: CudaGraphs | None = None,
    plan: GraphPlan | None = None,
    build_masks: Callable[[], tuple[torch.Tensor, ...]] | None = None,
    spans: Sequence[Spans] | None = None,
) -> PendingGeneration:
    """``generate_semantic_ids`` without waiting: on CUDA the batch's work, ending with the
    copy of its results into pinned host memory, is queued on the current stream and this
    returns at once, so the host can prepare and queue the next batch (stream order keeps
    the graphs' reused buffers safe: this batch's outputs are copied before the next batch's
    replays overwrite them).

    Args:
        plan: the batch's ``graphs.plan``, when the caller made it already; None makes it
            here.
        build_masks: where some request has item rules, makes the batch's trie masks
            (``xgr.catalog.rules.CatalogMasks.masks``); called once the prefill is queued, so
            that its host work overlaps the prefill's device work. None: every valid path.
        spans: each prompt's given input embeddings (``xgr.engine.inputs.Spans``, checked),
            or None where no prompt has any.
        Others: as ``generate_semantic_ids``.
    """
    if graphs is None:
        return _launch(spec, prompts, beam_width, top_k, None, EAGER, build_masks, spans)
    with graphs.lock:  # one launch at a time into the graphs' buffers
        if plan is None:
            together = spec.runner.first_levels_together(len(prompts), beam_width)
            lens = [len(p) for p in prompts]
            filtered, embedded = build_masks is not None, spans is not None
            plan = graphs.plan(
                lens, beam_width, top_k, together, filtered=filtered, embedded=embedded
            )
        return _launch(spec, prompts, beam_width, top_k, graphs, plan, build_masks, spans)


def _launch(
    spec, prompts, beam_width, top_k, graphs, plan: GraphPlan, build_masks, spans=None
) -> PendingGeneration:
    runner = spec.runner
    device = spec.scorer.sid_token_ids.device
    cuda = device.type == "cuda"
    if cuda:
        # The events are recorded on the current stream: key the pool by its device.
        index = torch.cuda.current_device()
        events = _TIMING_EVENTS.take(index)
        events[0].record()
    start = time.perf_counter()
    together = runner.first_levels_together(len(prompts), beam_width)
    graphed = plan.decode is not None
    if plan.prefill is not None:  # the inputs go straight to where the graph reads them
        inputs = graphs.stage(prompts, plan.prefill, spans)
        prefilled = graphs.replay_prefill(inputs)
    else:
        weight = runner.model.lm_head.weight
        inputs = prepare_inputs(prompts, device, spans, runner.hidden_size, weight.dtype)
        shared = graphs.shared_kv(inputs) if graphed else allocate_shared_kv(runner.model, inputs)
        code_kv = None
        if together:  # a graphed search reads the graphs' own level-1 K/V
            code_kv = graphs.code_kv() if graphed else runner.allocate_code_kv(len(prompts))
        prefilled = runner.prefill(inputs.prefill_batch(shared, code_kv))
    if cuda:
        events[1].record()
    prefilled_at = time.perf_counter()
    allowed = build_masks() if build_masks is not None else None
    if graphed:
        searched = graphs.replay_decode(spec, plan.decode, inputs, prefilled, allowed)
    else:
        batch = LevelBatch(shared, inputs.prompt_lens, inputs.cu_seqlens_host, allowed)
        searched = search_levels(spec, batch, prefilled, beam_width, top_k, together)
    if not cuda:
        done = time.perf_counter()
        host_ms = ((prefilled_at - start) * 1e3, (done - prefilled_at) * 1e3)
        return PendingGeneration(*searched.tensors(), host_ms=host_ms)
    events[2].record()
    # The one device-to-host copy, into pinned memory so that it is queued, not waited for.
    outputs = searched.tensors()
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in outputs]
    for dst, src in zip(host, outputs, strict=True):
        dst.copy_(src, non_blocking=True)
    events[3].record()
    return PendingGeneration(*host, events, device_index=index)
