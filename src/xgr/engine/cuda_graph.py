"""CUDA graphs of a request batch: prefill over padded token buckets, and the decode levels.

Eager PyTorch pays a host launch for every kernel (hundreds per forward), which sets a floor
on a prefill whatever its length. Graphs replay the same work with no host involvement:

- **prefill** graphs are keyed by the prefill's padded shape (``xgr.runner.PrefillShape``,
  computed by the model's runner): decoder-only prompts are packed and followed by padding
  up to a token bucket (eight buckets per power of two, so at most 1/8 of a prefill is
  padding), the requests a batch lacks standing in as sequences of the padding, so one
  graph serves every batch size; an encoder's prompts each take a slot padded to one
  length.
- **decode** graphs are keyed by ``DecodeGraphKey`` and hold every level's selection,
  decode forward and KV bookkeeping (``xgr.engine.search``); prompt lengths enter only
  through device tensors.

Prefill graphs are kept per runner (a key is (runner, shape)), decode graphs per catalog
version's ``DecodeSpec`` (the trie they read), so batches of several catalogs alternate
without capturing again, and a new version whose first-level codes are the old one's keeps
its prefill graphs.

``CudaGraphs.plan`` is the one place that decides graph or eager for a batch, and logs
why a batch runs eagerly. A batch's host-built inputs reach the device in one copy, straight
into a staging buffer whose views are the graphs' static inputs
(``xgr.engine.inputs.InputStaging``). Both kinds of graph read and write one prompt-KV pool
(``xgr.engine.kv_pool``) that grows in powers of two, dropping the graphs, which hold its
address. Graphs are captured on first use, after one eager warm-up run that compiles the
Triton kernels, and kept in an LRU (``xgr.engine.graph_cache``); all share one memory pool,
which is safe because replays never overlap (a lock serializes launches, and one lane's
batches queue on one stream) and each batch's results are copied out, in stream order,
before the next batch's replays.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Sequence

import torch

from xgr.engine.graph_cache import GraphCache
from xgr.engine.graph_keys import MAX_GRAPH_WORKSPACE_BYTES, DecodeGraphKey, GraphPlan
from xgr.engine.inputs import BatchInputs, InputStaging
from xgr.engine.kv_pool import PromptKVPool
from xgr.engine.search import Searched, search_levels
from xgr.engine.spec import DecodeSpec
from xgr.kv import BeamKV, SharedKV
from xgr.runner import LevelBatch, ModelRunner, PrefillBatch, Prefilled, PrefillShape
from xgr.runner.shapes import next_power_of_two

# The fewest prefill tokens the staging buffer makes room for once a batch brings given
# embeddings: growing it drops every graph, and most prompts are within this many tokens.
EMBED_TOKENS_FLOOR = 8192

logger = logging.getLogger(__name__)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of the same memory."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class CudaGraphs:
    """Captured prefill and decode graphs of one model, with their inputs' staging buffer,
    the prompt-KV pool and level 1's K/V buffer that they read at fixed addresses.

    Args:
        runner: the model's runner (on a CUDA device).
        max_requests: the largest batch (requests) captured; larger batches run eagerly.
        max_prefill_tokens: the largest padded prefill captured; longer ones run eagerly.
        max_graphs: graphs kept; the least recently used is dropped beyond this.

    Callers hold ``lock`` from ``stage`` (or ``shared_kv``) until the copy of
    ``replay_decode``'s outputs is queued on the stream (``xgr.engine.generate`` does).
    """

    def __init__(
        self,
        runner: ModelRunner,
        max_requests: int = 64,
        max_prefill_tokens: int = 65536,
        max_graphs: int = 512,
    ) -> None:
        self.runner = runner
        self.model = runner.model
        self.max_requests = max_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.lock = threading.RLock()
        self.cache = GraphCache(max_graphs)
        self._prompt_kv = PromptKVPool(runner.model)
        self._staging: InputStaging | None = None
        self._code_kv: dict[ModelRunner, BeamKV | None] = {}  # by runner
        self._spec: DecodeSpec | None = None  # the spec in use (``use``)
        self._served: tuple[int, ...] = ()  # ids of it and the specs kept with it
        # Prompt offsets of the last batch of each decode key, and when it ran (monotonic
        # s; ``decode_batches``).
        self._decode_offsets: dict[DecodeGraphKey, tuple[list[int], float]] = {}
        # Room in the staging buffer for given embeddings: the largest padded prefill with
        # them planned so far, as a power of two, and at least EMBED_TOKENS_FLOOR.
        self._embed_tokens = 0

    def plan(
        self,
        prompt_lens: list[int],
        beam_width: int,
        top_k: int,
        together: bool,
        log: bool = True,
        filtered: bool = False,
        embedded: bool = False,
        runner: ModelRunner | None = None,
    ) -> GraphPlan:
        """Which graphs a batch of prompts of these lengths (tokens) replays; with ``log``,
        a line says why a part runs eagerly (none for prefills the model never graphs, such
        as several float32 prompts of a decoder-only model).

        Args:
            together: level 1's forward runs in the pass before it for this batch
                (``ModelRunner.first_levels_together``).
            filtered: some request of the batch has item rules (``DecodeGraphKey.filtered``).
            embedded: some prompt of the batch has given input embeddings
                (``PrefillShape.embeds``).
            runner: the batch's catalog version's runner (default: ``runner``).
        """
        num = len(prompt_lens)
        if num > self.max_requests:
            if log:
                logger.info(
                    "batch of %d requests is above the CUDA-graph limit %d: running eagerly",
                    num,
                    self.max_requests,
                )
            return GraphPlan(None, None)
        decode = DecodeGraphKey(num, beam_width, top_k, together, filtered)
        runner = runner or self.runner
        shape = runner.prefill_shape(prompt_lens, self.max_requests, together)
        if shape is None:
            return GraphPlan(None, decode)
        too_large = shape.padded_tokens > self.max_prefill_tokens
        if too_large or shape.workspace_bytes > MAX_GRAPH_WORKSPACE_BYTES:
            if log:
                logger.info(
                    "prefill of %d tokens (longest prompt %d) is above the CUDA-graph "
                    "limits: running it eagerly",
                    sum(prompt_lens),
                    max(prompt_lens),
                )
            return GraphPlan(None, decode)
        if embedded:
            shape = dataclasses.replace(shape, embeds=True)
            room = max(next_power_of_two(shape.padded_tokens), EMBED_TOKENS_FLOOR)
            self._embed_tokens = max(self._embed_tokens, min(room, self.max_prefill_tokens))
        return GraphPlan(shape, decode)

    def needs_capture(self, plan: GraphPlan, prompt_lens: list[int], spec: DecodeSpec) -> bool:
        """Whether running a batch so planned, over ``spec``, would capture a graph or grow
        the KV pool."""
        if plan.decode is None:
            return False  # eager
        if self._staging_stale():
            return True  # a new staging buffer drops the graphs
        tokens = plan.prefill.padded_tokens if plan.prefill else sum(prompt_lens)
        if tokens > self.pool_tokens:
            return True
        if plan.prefill is not None and (spec.runner, plan.prefill) not in self.cache:
            return True
        return (spec, plan.decode) not in self.cache

    def stage(
        self, prompts: Sequence[Sequence[int]], shape: PrefillShape, spans=None
    ) -> BatchInputs:
        """A batch's inputs (and its prompts' given embeddings, ``spans``) written where
        its prefill graph reads them (``InputStaging``), in one copy on the current stream."""
        return self._staging_buffer().stage(prompts, shape, spans)

    def _staging_stale(self) -> bool:
        """Whether the staging buffer was made for other ``max_requests`` /
        ``max_prefill_tokens`` than the current ones, or without room for the given
        embeddings planned."""
        staging = self._staging
        limits = (self.max_requests, self.max_prefill_tokens, self._embed_tokens)
        if staging is None:
            return False
        return (staging.max_requests, staging.max_tokens, staging.embed_tokens) != limits

    def _staging_buffer(self) -> InputStaging:
        """The staging buffer, made at first use (or again, dropping every graph, after
        ``max_requests`` or ``max_prefill_tokens`` changed)."""
        if self._staging_stale():
            if self._staging.buffer.is_cuda:  # a launched batch may read it
                torch.cuda.synchronize(self._staging.buffer.device)
            self.cache.clear()  # the graphs read the old buffer
            self._staging = None
        if self._staging is None:
            weight = self.model.lm_head.weight
            self._staging = InputStaging(
                self.max_requests, self.max_prefill_tokens, weight.device, self._embed_tokens,
                self.runner.hidden_size, weight.dtype,
            )  # fmt: skip
        return self._staging

    def use(self, spec: DecodeSpec, live: Sequence[DecodeSpec] = ()) -> None:
        """Run from now on over ``spec`` (a catalog version's). Prefill graphs and level
        1's K/V buffer are kept per runner, decode graphs per spec, so batches of several
        catalogs alternate without capturing again; those of neither ``spec`` nor ``live``
        (the versions still served) are dropped, once the device is done with them.
        Callers hold ``lock``."""
        owners = (spec, *live)
        served = tuple(map(id, owners))  # a cache key holds its spec: no id is reused
        if served == self._served:
            return
        self._served = served
        keep = {id(s) for s in owners} | {id(s.runner) for s in owners}
        stale = [key for key in self.cache.keys() if id(key[0]) not in keep]
        retired = [r for r in self._code_kv if id(r) not in keep]
        if stale or retired:
            weight = self.model.lm_head.weight
            if weight.is_cuda:  # a launched batch may still replay the graphs
                torch.cuda.synchronize(weight.device)
            self.cache.drop(stale)
            for r in retired:
                del self._code_kv[r]
        self.runner, self._spec = spec.runner, spec

    @property
    def pool_tokens(self) -> int:
        return self._prompt_kv.tokens

    def keys(self) -> list:
        """The prefill shapes and decode keys of the graphs held for the spec in use (its
        runner's prefills), least recently used first."""
        return [
            key for owner, key in self.cache.keys() if owner is self.runner or owner is self._spec
        ]

    def decode_batches(
        self, spec: DecodeSpec, since: float = float("-inf")
    ) -> list[tuple[DecodeGraphKey, list[int]]]:
        """The decode graphs held for ``spec`` and replayed after ``since`` (monotonic s),
        most recently used first, each with the prompt lengths (tokens) of the last batch
        that replayed its key: batches that capture the same graphs over another spec
        (``capture_ahead``)."""
        keys = [key for owner, key in self.cache.keys() if owner is spec]
        batches = []
        for key in reversed(keys):
            offsets, at = self._decode_offsets.get(key, (None, since))
            if offsets is not None and at > since:
                batches.append((key, [b - a for a, b in itertools.pairwise(offsets)]))
        return batches

    @property
    def captures(self) -> int:
        """Graphs captured so far (for tests and logs)."""
        return self.cache.captures

    def shared_kv(self, inputs: BatchInputs) -> SharedKV:
        """The pool as an eagerly prefilled batch's prompt KV, grown (and graphs dropped)
        if too small."""
        self.reserve(inputs.num_tokens)
        return self._prompt_kv.view(inputs.cu_seqlens, [])

    def reserve(self, num_tokens: int) -> None:
        """Grow the prompt-KV pool to hold ``num_tokens`` (dropping every graph, which hold
        the old pool's address) if smaller.

        A warm-up reserves its largest batch first: growing later would drop the graphs
        captured before.
        """
        if num_tokens > self.pool_tokens:
            self.cache.clear()
            self._prompt_kv.grow(num_tokens)

    def release(self) -> None:
        """Drop every graph and the buffers they read (made again by the next batch), once
        the device has finished with them."""
        if self._prompt_kv.k is not None and self._prompt_kv.k.is_cuda:
            torch.cuda.synchronize(self._prompt_kv.k.device)
        self.cache.clear()
        self._prompt_kv.release()
        self._staging = None
        self._code_kv.clear()
        self._served = ()

    def code_kv(self) -> BeamKV | None:
        """The K/V that level 1's rows of a single-request prefill write, graphed or eager,
        and that the decode graphs read: one buffer at one address, made once
        (``ModelRunner.allocate_code_kv``; None for a model whose prefill runs none)."""
        if self.runner not in self._code_kv:
            self._code_kv[self.runner] = self.runner.allocate_code_kv(1)
        return self._code_kv[self.runner]

    def replay_prefill(self, inputs: BatchInputs) -> Prefilled:
        """Prefill a batch from its shape's graph; writes the pool's KV.

        Args:
            inputs: the batch as this object's ``stage`` wrote it, and nothing staged since.

        Returns:
            The graph-owned ``Prefilled`` of the batch's requests (its level 1's K/V, where
            they ran, ``code_kv``'s).

        Raises:
            ValueError: the inputs were not staged here (``prepare_inputs`` packs for
                eager runs).
        """
        shape, staging = inputs.prefill_key, self._staging
        if shape is None or staging is None or inputs.buffer is not staging.buffer:
            raise ValueError("replay_prefill needs inputs from this CudaGraphs' stage()")
        self.reserve(shape.padded_tokens)
        code_kv = self.code_kv() if shape.code_rows else None
        entry = self.cache.replay(
            (self.runner, shape), lambda: self._build_prefill(shape, inputs, code_kv)
        )
        return entry.outputs.narrow(inputs.num_requests)

    def _build_prefill(self, shape: PrefillShape, inputs: BatchInputs, code_kv):
        """``GraphCache.replay``'s ``build`` of a prefill graph: the staging buffer's views
        as the ``PrefillBatch``."""
        staging = self._staging
        slots, padded = shape.slots, shape.padded_tokens
        offsets = staging.region("cu_seqlens", slots + 1)
        batch = PrefillBatch(
            tokens=staging.region("tokens", padded),
            positions=staging.region("positions", padded, padded) if shape.reads_positions
            else None,
            shared=self._prompt_kv.view(offsets, []),
            # One request: a causal pass over the whole buffer (padding last changes nothing
            # before it); several: the packed launch keeps the sequences apart.
            attention_offsets_host=[0, padded],
            attention_offsets=staging.cu_seqlens_int32(slots + 2),
            max_seqlen=shape.max_seqlen,
            packed=slots > 1,
            last_index=staging.region("last_index", slots),
            prompt_lens=staging.region("prompt_lens", slots),
            prompt_offsets=offsets,
            # The capturing batch's, read only by the torch reference attention.
            prompt_offsets_host=inputs.cu_seqlens_host,
            slot_tokens=shape.slot_tokens,
            code_kv=code_kv,
            embeds=staging.embeds(padded) if shape.embeds else None,
        )  # fmt: skip
        return (batch.tokens,), lambda: self.runner.prefill(batch)

    def replay_decode(
        self,
        spec: DecodeSpec,
        key: DecodeGraphKey,
        inputs: BatchInputs,
        prefilled: Prefilled,
        allowed: tuple[torch.Tensor, ...] | None = None,
    ) -> Searched:
        """Run the search of a prefilled batch from its key's graph.

        Args:
            spec: the ``DecodeSpec`` the graph runs (its runner is this object's).
            key: the batch's ``GraphPlan.decode``.
            inputs: the batch's ``BatchInputs`` (device offsets and lengths).
            prefilled: the batch's prefill output, from a graph or eager; its level 1's
                K/V, where they ran, must be ``code_kv``'s (the graphs read it at its
                address).
            allowed: the batch's trie masks (``LevelBatch.allowed``), exactly when
                ``key.filtered``; copied into the graph's own.

        Returns:
            The graph-owned final beams (``Searched``); copy them before the next call.

        Raises:
            ValueError: level 1's K/V are not ``code_kv``'s, or the prefill's outputs do not
                match those the graph was captured with.
        """
        if prefilled.code_kv is not None and prefilled.code_kv is not self._code_kv.get(
            self.runner
        ):
            raise ValueError("level 1's K/V must be this object's code_kv()")
        if key.filtered != (allowed is not None):
            raise ValueError("replay_decode needs the trie masks exactly when key.filtered")
        masks = tuple(allowed or ())
        self._decode_offsets[key] = (inputs.cu_seqlens_host, time.monotonic())
        # Made again here after a limit changed, as ``needs_capture`` predicts, also for an
        # eagerly prefilled batch.
        staging = self._staging_buffer()
        batch_inputs = (*prefilled.tensors(), *masks, inputs.prompt_lens, inputs.cu_seqlens)

        def build():
            # The offsets and lengths are the staging buffer's (a staged batch's own, no
            # copy); the prefill's outputs are copied in (their addresses depend on the
            # prefill graph).
            num = key.requests
            static = prefilled.like()
            static_masks = tuple(torch.empty_like(m) for m in masks)
            offsets = staging.region("cu_seqlens", num + 1)
            batch = LevelBatch(
                self._prompt_kv.view(offsets, []), staging.region("prompt_lens", num),
                inputs.cu_seqlens_host, static_masks or None,
            )  # fmt: skip

            def run():
                return search_levels(
                    spec, batch, static, key.beam_width, key.top_k, key.first_levels_together
                )

            return (*static.tensors(), *static_masks, batch.prompt_lens, offsets), run

        def fill(static):
            if len(static) != len(batch_inputs):
                raise ValueError(
                    "the prefill's outputs do not match the decode graph's: level 1's rows "
                    "must be given exactly when they ran"
                )
            for dst, src in zip(static, batch_inputs, strict=True):
                if not _same_view(dst, src):  # an eagerly prefilled batch's, or the hidden
                    dst.copy_(src)

        return self.cache.replay((spec, key), build, fill).outputs
