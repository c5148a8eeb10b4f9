"""CUDA graphs of a request batch: prefill over padded token buckets, and the decode levels.

Eager PyTorch pays a host launch for every kernel (hundreds per forward); on the H200's host
that set a floor of about 20 ms on a prefill whatever its length. Graphs replay the same work
with no host involvement:

- **prefill** graphs are keyed by padded tokens (and, for several requests, a power-of-two
  bound on the sequence length): the batch's packed prompts are followed by padding up to a
  bucket size (``xgr.engine.graph_keys``: eight buckets per power of two, at least
  ``PREFILL_BUCKET`` tokens apart, so
  at most 1/8 of a prefill is padding), so prompts of any lengths with the same total reuse
  one graph. Padding tokens form their own sequences: with one request a causal attention
  over the whole buffer leaves the real tokens' results unchanged (padding comes last);
  with several, the packed attention launch keeps sequences apart by their device offsets, and
  the requests a batch lacks (up to ``max_requests``) stand in as sequences of the
  padding, so one graph serves every batch size: under load the set of graphs stays
  small (a graph per (requests, bucket) pair thrashed the cache and captured per batch).
- **decode** graphs are keyed by (requests, beam width, top-k, whether level 1 ran within
  the step before, ``xgr.engine.decode.runs_first_levels_together``) and hold every level's
  selection, decode forward and KV bookkeeping; prompt lengths enter only through device
  tensors (offsets and lengths read by the kernels). A single request's prefill graph that
  also runs level 1 is keyed apart (the prefill keys' last field) and writes its code rows'
  K/V into one buffer that the decode graphs read (``level_one_kv``).

A batch's host-built inputs reach the device in one copy, straight into a staging buffer
whose views are the graphs' static inputs (``xgr.engine.inputs.InputStaging``): no
device-to-device fill runs before a replay. Both read and write one prompt-KV pool that
grows in powers of two (dropping the graphs, which hold its address). Graphs are captured
on first use of a shape, after one eager warm-up run that compiles the Triton kernels, and
kept in an LRU (``xgr.engine.graph_cache``); all share one memory pool, which is safe
because replays never overlap (a lock serializes launches, and one lane's batches queue on
one stream) and each batch's results are copied out, in stream order, before the next
batch's replays. Batches beyond
``max_requests`` or ``max_prefill_tokens`` run eagerly, with a log line.
"""

from __future__ import annotations

import logging
import threading

import torch

from xgr.engine.graph_cache import GraphCache
from xgr.engine.graph_keys import encode_key, padded_shape
from xgr.engine.inputs import BatchInputs, InputStaging
from xgr.engine.kv_pool import PromptKVPool
from xgr.kv import BeamKV, SharedKV

logger = logging.getLogger(__name__)


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of the same memory."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()


class CudaGraphs:
    """Captured prefill and decode graphs of one model, and the prompt-KV pool they use.

    Args:
        model: the model whose layers the graphs run (on a CUDA device).
        max_requests: the largest batch (requests) captured; larger batches run eagerly.
        max_prefill_tokens: the largest padded prefill captured; longer ones run eagerly.
        max_graphs: graphs kept; the least recently used is dropped beyond this.

    Callers hold ``lock`` from ``shared_kv`` until the copy of ``replay_decode``'s outputs is
    queued on the stream (``xgr.engine.generate`` does).
    """

    def __init__(
        self,
        model,
        max_requests: int = 64,
        max_prefill_tokens: int = 65536,
        max_graphs: int = 512,
    ) -> None:
        self.model = model
        self.max_requests = max_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.lock = threading.RLock()
        self.cache = GraphCache(max_graphs)
        self._prompt_kv = PromptKVPool(model)
        self._staging: InputStaging | None = None
        self._level_one: BeamKV | None = None  # ``_level_one_kv``

    def accepts(self, num_requests: int) -> bool:
        """Whether a batch of this many requests replays graphs (else: eager, logged)."""
        if num_requests <= self.max_requests:
            return True
        logger.info(
            "batch of %d requests is above the CUDA-graph limit %d: running eagerly",
            num_requests,
            self.max_requests,
        )
        return False

    def stage(self, prompts, level_one: bool = False) -> BatchInputs | None:
        """A batch's inputs written where its prefill graph reads them (``InputStaging``),
        in one copy on the current stream; None where its prefill runs eagerly (logged).

        Several requests share one padded buffer through the packed attention launch (used
        for fp16/bf16); a float32 batch of several requests prefills eagerly (without a log
        line: expected).

        Args:
            prompts: R non-empty token sequences (lists or int64 arrays).
            level_one: a decoder-only prefill also runs level 1's forward
                (``xgr.engine.decode.runs_first_levels_together``); an encoder's ignores it.
        """
        lens = [len(p) for p in prompts]
        key = self.prefill_key(lens, level_one)
        if key is None:
            if not self._eager_kind(len(lens)):  # then the size is the reason
                logger.info(
                    "prefill of %d tokens (longest prompt %d) is above the CUDA-graph limits: "
                    "running it eagerly",
                    sum(lens),
                    max(lens),
                )
            return None
        slots, padded = key[1], key[2]
        staging = self._staging_buffer()
        decoder_only = key[0] == "prefill"
        return staging.stage(prompts, slots, padded, decoder_only, key)

    def _staging_stale(self) -> bool:
        """Whether the staging buffer was made for other ``max_requests`` /
        ``max_prefill_tokens`` than the current ones."""
        staging = self._staging
        limits = (self.max_requests, self.max_prefill_tokens)
        return staging is not None and (staging.max_requests, staging.max_tokens) != limits

    def _staging_buffer(self) -> InputStaging:
        """The staging buffer, made at first use (or again, dropping every graph, after
        ``max_requests`` or ``max_prefill_tokens`` changed)."""
        if self._staging_stale():
            if self._staging.buffer.is_cuda:  # a launched batch may read it
                torch.cuda.synchronize(self._staging.buffer.device)
            self._drop_graphs()  # they read the old buffer
            self._staging = None
        if self._staging is None:
            device = self.model.lm_head.weight.device
            self._staging = InputStaging(self.max_requests, self.max_prefill_tokens, device)
        return self._staging

    @property
    def pool_tokens(self) -> int:
        return self._prompt_kv.tokens

    def shared_kv(self, inputs, num_tokens: int | None = None) -> SharedKV:
        """The pool as this batch's prompt KV, grown (and graphs dropped) if too small.

        Args:
            inputs: the batch's ``BatchInputs``.
            num_tokens: tokens the pool must hold (a padded prefill); default the batch's.
        """
        self.reserve(max(num_tokens or 0, inputs.num_tokens))
        return self._pool(inputs.cu_seqlens, inputs.seqlens)

    def _pool(self, cu_seqlens: torch.Tensor, seqlens: list[int]) -> SharedKV:
        return self._prompt_kv.view(cu_seqlens, seqlens)

    def reserve(self, num_tokens: int) -> None:
        """Grow the prompt-KV pool to hold ``num_tokens`` (dropping every graph, which hold
        the old pool's address) if smaller.

        A warm-up reserves its largest batch first: growing later would drop the graphs
        captured before.
        """
        if num_tokens > self.pool_tokens:
            self._drop_graphs()
            self._prompt_kv.grow(num_tokens)

    @property
    def captures(self) -> int:
        """Graphs captured so far (for tests and logs)."""
        return self.cache.captures

    def _drop_graphs(self) -> None:
        self.cache.clear()

    def replay_prefill(self, inputs: BatchInputs, spec=None) -> tuple:
        """Prefill a batch from its bucket's graph; writes the pool's KV.

        Args:
            inputs: the batch as this object's ``stage`` wrote it, and nothing staged since.
            spec: the ``DecodeSpec`` whose first-level codes level 1's rows run, when
                ``stage`` was told ``level_one``; else None.

        Returns:
            last_hidden: (R, hidden) graph-owned final hidden state of each prompt's last
                token; None for an encoder-decoder (its encoder writes the cross-attention
                K/V).
            level_one: None, or level 1's (V0, hidden) graph-owned hidden states and the
                one-slot ``BeamKV`` its rows wrote (kept by this object: the next prefill
                that runs level 1 overwrites it), for ``replay_decode``.

        Raises:
            ValueError: the inputs were not staged (``prepare_inputs`` packs for eager
                runs), or ``spec`` is missing or given against the staged key.
        """
        key, staging = inputs.prefill_key, self._staging
        if key is None or staging is None or inputs.buffer is not staging.buffer:
            raise ValueError("replay_prefill needs inputs from this CudaGraphs' stage()")
        if key[0] == "encode":
            self._replay_encode(key)
            return None, None
        level_one = key[4]
        if level_one != (spec is not None):
            raise ValueError("replay_prefill needs a spec exactly when staged with level_one")
        self.reserve(key[2])
        kv = self.level_one_kv(spec) if level_one else None
        entry = self.cache.replay(key, lambda: self._build_prefill(key, inputs, spec, kv))
        hidden, num = entry.outputs[0], inputs.num_requests
        if not level_one:
            return hidden[:num], None
        return hidden[:num], (hidden[num:], kv)

    def _build_prefill(self, key: tuple, inputs: BatchInputs, spec, kv):
        """``_replay``'s ``build`` of a decoder-only prefill graph."""
        from xgr.engine.decode import level_one_inputs, level_one_metadata
        from xgr.layers.attention import PrefillMetadata

        _, slots, padded, max_seqlen, _ = key
        staging = self._staging
        cu = staging.cu_seqlens_int32(slots + 2)
        shared = self._pool(cu, [])
        first_codes = None
        if kv is not None:  # one request: its offsets and length in the staged layout
            code_shared = self._pool(staging.region("cu_seqlens", slots + 1), [])
            first_codes = level_one_metadata(spec, code_shared, kv, inputs.cu_seqlens_host)
        # One request: a causal pass over the whole buffer (padding last changes nothing
        # before it); several: the packed attention launch keeps the sequences apart.
        last = staging.region("last_index", slots)
        meta = PrefillMetadata(
            shared, [0, padded], cu, max_seqlen, packed=slots > 1, output_rows=last,
            first_codes=first_codes,
        )  # fmt: skip
        tokens = staging.region("tokens", padded)
        positions = staging.region("positions", padded, padded)

        def run():
            if kv is None:
                return (self.model(tokens, positions, meta),)
            ids, code_positions = level_one_inputs(spec, staging.region("prompt_lens", slots))
            pass_ids = torch.cat((tokens, ids))
            return (self.model(pass_ids, torch.cat((positions, code_positions)), meta),)

        return (tokens,), run

    def level_one_kv(self, spec) -> BeamKV:
        """The one-slot K/V that level 1's rows of a single-request prefill write, graphed
        or eager, and that the decode graphs read: one buffer at one address, made once
        (again, dropping the graphs that use the old one, if the code count changed)."""
        from xgr.engine.decode import level_one_kv

        rows = spec.first_codes.shape[0]
        if self._level_one is not None and self._level_one.rows.shape[0] != rows:
            self._drop_graphs()
            self._level_one = None
        if self._level_one is None:
            self._level_one = level_one_kv(spec, 1)
        return self._level_one

    def _replay_encode(self, key: tuple) -> None:
        """Run an encoder-decoder's encoder from its graph (``T5Seq2SeqLM.encode_padded``):
        the cross-attention K/V of the batch's prompts land packed at the pool's start."""
        _, slots, padded, length = key
        self.reserve(padded)
        staging = self._staging

        def build():
            tokens = staging.region("tokens", padded)
            lengths = staging.region("prompt_lens", slots)
            shared = self._pool(staging.region("cu_seqlens", slots + 1), [])

            def run():
                self.model.encode_padded(tokens, lengths, length, shared)
                return ()

            return (tokens,), run

        self.cache.replay(key, build)

    def needs_capture(
        self, prompt_lens: list[int], beam_width: int, top_k: int, level_one: bool = False
    ) -> bool:
        """Whether running this batch would capture a graph or grow the KV pool
        (``level_one``: ``xgr.engine.decode.runs_first_levels_together`` for the batch)."""
        num = len(prompt_lens)
        if num > self.max_requests:
            return False  # eager
        if self._staging_stale():
            return True  # a new staging buffer drops the graphs
        key = self.prefill_key(prompt_lens, level_one)
        if (key[2] if key else sum(prompt_lens)) > self.pool_tokens:
            return True
        if key is not None and key not in self.cache:
            return True
        return ("decode", num, beam_width, top_k, level_one) not in self.cache

    def prefill_key(self, prompt_lens: list[int], level_one: bool = False) -> tuple | None:
        """The graph a batch of prompts of these lengths (tokens) replays for its prefill
        (``level_one``: as ``stage``); None where that prefill runs eagerly (too many
        requests or tokens, float32 batches)."""
        total, num = sum(prompt_lens), len(prompt_lens)
        if num > self.max_requests or self._eager_kind(num):
            return None
        if self.model.is_encoder_decoder:
            return encode_key(self.model, num, max(prompt_lens), self.max_requests,
                              self.max_prefill_tokens)  # fmt: skip
        shape = padded_shape(total, num, max(prompt_lens), self.max_requests)
        return None if shape[1] > self.max_prefill_tokens else ("prefill", *shape, level_one)

    def _eager_kind(self, num_requests: int) -> bool:
        """Prefills that never replay a graph, whatever their size: several float32 prompts
        of a decoder-only model (the packed attention launch, used for fp16/bf16, shares one
        padded buffer; an encoder pads each prompt to its own slot and needs no such kernel)."""
        float32 = self.model.lm_head.weight.dtype == torch.float32
        return not self.model.is_encoder_decoder and num_requests > 1 and float32

    def replay_decode(self, spec, last_hidden, inputs, beam_width: int, top_k: int, level_one=None):
        """Run the decode levels of a prefilled batch from its shape's graph.

        Args:
            spec: the ``DecodeSpec`` (model, trie, scoring) the graph runs.
            last_hidden: (R, hidden) prefill output at each prompt's last token; None for
                an encoder-decoder (its decoder starts from the start token).
            inputs: the batch's ``BatchInputs`` (device offsets and lengths).
            beam_width, top_k: search parameters.
            level_one: None, or ``replay_prefill``'s (or an eager prefill's) level 1: its
                rows' hidden states and their one-slot ``BeamKV``, which must be
                ``level_one_kv``'s (the graphs read it at its address).

        Returns:
            nodes, scores: (R, beam_width) graph-owned outputs; copy them before the next call.

        Raises:
            ValueError: level 1's rows are given for a batch that runs it after level 0, or
                missing for one that runs it within the prefill, or their K/V are not
                ``level_one_kv``'s.
        """
        from xgr.engine.decode import (
            decode_levels,
            decode_levels_encdec,
            runs_first_levels_together,
        )

        # Whether level 1 runs in the pass before it: a key of its own, so that a switch of
        # ``FIRST_LEVELS_TOGETHER`` never replays a graph of the other path.
        together = runs_first_levels_together(spec, inputs.num_requests, beam_width)
        if not spec.model.is_encoder_decoder and together != (level_one is not None):
            raise ValueError("replay_decode needs level 1's prefill rows exactly when they ran")
        if level_one is not None and level_one[1] is not self._level_one:
            raise ValueError("level 1's K/V must be this object's level_one_kv()")
        key = ("decode", inputs.num_requests, beam_width, top_k, together)
        if spec.model.is_encoder_decoder:
            batch = (inputs.cu_seqlens,)
        else:
            batch = (last_hidden, inputs.prompt_lens, inputs.cu_seqlens)
        if level_one is not None:
            batch = (level_one[0], *batch)
        # Made again here after a limit changed, as ``needs_capture`` predicts, also for an
        # eagerly prefilled batch.
        staging = self._staging_buffer()

        def build():
            # The offsets and lengths are the staging buffer's (a staged batch's own, no
            # copy); the prefill's output is copied in (its graph, and so its address,
            # depends on the prefill bucket).
            num = inputs.num_requests
            static = (staging.region("cu_seqlens", num + 1),)
            if not spec.model.is_encoder_decoder:
                lens = staging.region("prompt_lens", num)
                static = (torch.empty_like(last_hidden), lens, *static)
            if level_one is not None:  # its K/V stay where the prefill wrote them
                static = (torch.empty_like(level_one[0]), *static)
            shared = self._pool(static[-1], [])
            # The kernels read prompt offsets from the device; the host offsets of the
            # capturing batch reach only the torch reference attention, never used here.
            host_cu = inputs.cu_seqlens_host

            def run():
                if spec.model.is_encoder_decoder:
                    return decode_levels_encdec(spec, shared, host_cu, beam_width, top_k)
                first = None if level_one is None else (static[0], level_one[1])
                hidden, lens, _ = static[-3:]
                return decode_levels(spec, hidden, lens, shared, host_cu, beam_width, top_k, first)

            return static, run

        def fill(static):
            for dst, src in zip(static, batch, strict=True):
                if not _same_view(dst, src):  # an eagerly prefilled batch's, or the hidden
                    dst.copy_(src)

        return self.cache.replay(key, build, fill).outputs
