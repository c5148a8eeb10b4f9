"""CUDA graphs of the decode levels: one graph per batch shape, replayed with no host sync.

A graph holds every level's selection, decode forward and KV bookkeeping for one
(requests, beam width, top-k) shape; prompt lengths enter only through device tensors
(offsets and lengths read by the kernels), so one graph serves any prompt lengths whose
total fits the prompt-KV pool. Prefill stays eager (its kernels are large, so launch cost is
hidden behind them) and writes into the pool the graphs read.

Graphs are captured on first use of a shape (after one eager warm-up run that compiles the
Triton kernels) and kept in a small LRU; all share one memory pool, which is safe because
replays never overlap and each result is copied out before the next replay. Batches with
more requests than ``max_requests`` run eagerly, with a log line.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from xgr.kv import SharedKV

logger = logging.getLogger(__name__)

# The prompt-KV pool grows in powers of two from this many tokens.
MIN_POOL_TOKENS = 4096


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    last_hidden: torch.Tensor  # static inputs, copied into before each replay
    prompt_lens: torch.Tensor
    cu_seqlens: torch.Tensor
    nodes: torch.Tensor  # static outputs
    scores: torch.Tensor


class DecodeGraphs:
    """Captured decode graphs of one model and the prompt-KV pool they read.

    Args:
        model: the model whose layers the graphs run (on a CUDA device).
        max_requests: the largest batch (requests) captured; larger batches run eagerly.
        max_graphs: graphs kept; the least recently used is dropped beyond this.

    Not thread-safe by design of CUDA graphs; calls are serialized by an internal lock,
    held by the caller from ``shared_kv`` to the end of ``replay`` (see ``generate``).
    """

    def __init__(self, model, max_requests: int = 64, max_graphs: int = 16) -> None:
        self.model = model
        self.max_requests = max_requests
        self.max_graphs = max_graphs
        self.lock = threading.RLock()
        self._graphs: OrderedDict[tuple[int, int, int], _Graph] = OrderedDict()
        self._pool_k: torch.Tensor | None = None
        self._pool_v: torch.Tensor | None = None
        self._mempool = None
        self.captures = 0  # graphs captured so far (for tests and logs)

    def accepts(self, num_requests: int) -> bool:
        """Whether a batch of this many requests replays a graph (else: eager, logged)."""
        if num_requests <= self.max_requests:
            return True
        logger.info(
            "batch of %d requests is above the CUDA-graph limit %d: decoding eagerly",
            num_requests,
            self.max_requests,
        )
        return False

    @property
    def pool_tokens(self) -> int:
        return 0 if self._pool_k is None else self._pool_k.shape[1]

    def shared_kv(self, inputs) -> SharedKV:
        """The pool as this batch's prompt KV, grown (and graphs dropped) if too small."""
        if inputs.num_tokens > self.pool_tokens:
            tokens = MIN_POOL_TOKENS
            while tokens < inputs.num_tokens:
                tokens *= 2
            cfg = self.model.config
            weight = self.model.lm_head.weight
            shape = (cfg.num_layers, tokens, cfg.num_kv_heads, cfg.head_dim)
            self._graphs.clear()  # they read the old pool
            self._pool_k = self._pool_v = None
            self._pool_k = torch.empty(shape, dtype=weight.dtype, device=weight.device)
            self._pool_v = torch.empty_like(self._pool_k)
            logger.info(
                "prompt-KV pool: %d tokens (%.1f GiB)", tokens, 2 * self._pool_k.nbytes / 2**30
            )
        return SharedKV(self._pool_k, self._pool_v, inputs.cu_seqlens, inputs.seqlens)

    def replay(self, spec, last_hidden, inputs, beam_width: int, top_k: int):
        """Run the decode levels of a prefilled batch from its shape's graph.

        Args:
            spec: the ``DecodeSpec`` (model, trie, scoring) the graph runs.
            last_hidden: (R, hidden) prefill output at each prompt's last token.
            inputs: the batch's ``BatchInputs`` (device offsets and lengths).
            beam_width, top_k: search parameters.

        Returns:
            nodes, scores: (R, beam_width) graph-owned outputs; copy them before the next call.
        """
        from xgr.engine.generate import decode_levels

        key = (inputs.num_requests, beam_width, top_k)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(spec, decode_levels, last_hidden, inputs, beam_width, top_k)
            self._graphs[key] = entry
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
        else:
            self._graphs.move_to_end(key)
        entry.last_hidden.copy_(last_hidden)
        entry.prompt_lens.copy_(inputs.prompt_lens)
        entry.cu_seqlens.copy_(inputs.cu_seqlens)
        entry.graph.replay()
        return entry.nodes, entry.scores

    def _capture(self, spec, decode_levels, last_hidden, inputs, beam_width, top_k) -> _Graph:
        static_hidden = last_hidden.clone()
        static_lens = inputs.prompt_lens.clone()
        static_cu = inputs.cu_seqlens.clone()
        shared = SharedKV(self._pool_k, self._pool_v, static_cu, [])

        def run():
            return decode_levels(
                spec, static_hidden, static_lens, shared, inputs.cu_seqlens_host, beam_width, top_k
            )

        # Warm up on a side stream (compiles kernels, creates library handles) before capture.
        side = torch.cuda.Stream(device=last_hidden.device)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        if self._mempool is None:
            self._mempool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._mempool):
            nodes, scores = run()
        self.captures += 1
        logger.info(
            "captured decode graph: %d requests, beam width %d, top-k %d",
            inputs.num_requests,
            beam_width,
            top_k,
        )
        return _Graph(graph, static_hidden, static_lens, static_cu, nodes, scores)
