"""The batches a warm-up runs so that a load's CUDA graphs exist before the load, their
run on every lane, and the captures of a new catalog version's graphs before it is served."""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable, Sequence

import torch

from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.generate import generate_semantic_ids, launch_semantic_ids
from xgr.engine.inputs import PREFILL_PAD_TOKEN
from xgr.engine.lanes import Lane, Lanes
from xgr.engine.spec import DecodeSpec

# Prompt totals are stepped this finely (tokens): finer than any prefill bucket.
TOTAL_STEP = 32
# After each capture ahead of a new catalog version, a pause of this many times its
# duration: at 70% of capacity the requests queued behind a capture take about 2.3 times
# its time to be served.
CAPTURE_AHEAD_PAUSE = 3.0
# Graphs captured ahead are those replayed this recently (s): the shapes of the load being
# served (a warm-up's unused shapes are left to their first batch).
CAPTURE_AHEAD_RECENT_S = 30.0


def warm_up_batches(
    graphs: CudaGraphs,
    shortest: int,
    longest: int,
    max_batch_size: int,
    beam_width: int = 1,
    top_k: int = 1,
) -> tuple[list[list[int]], int]:
    """Prompt lengths of the batches that capture every graph such a load replays.

    One batch per new prefill graph (``CudaGraphs.plan``) or new batch size (its decode
    graph), over batches of 1..max_batch_size prompts of shortest..longest tokens searched
    with ``beam_width`` and ``top_k``; every lane's graphs have the same keys.

    Returns:
        the batches (each a list of prompt lengths, tokens), and the most prompt-KV tokens
        any of them needs (reserve it first: growing the pool drops the graphs).
    """
    batches, keys, sizes = [], set(), set()
    for size in range(1, max_batch_size + 1):
        for total in range(size * shortest, size * longest + 1, TOTAL_STEP):
            for lens in _batch_shapes(total, size, shortest, longest):
                together = graphs.runner.first_levels_together(size, beam_width)
                key = graphs.plan(lens, beam_width, top_k, together, log=False).prefill
                if key not in keys or size not in sizes:
                    keys.add(key)
                    sizes.add(size)
                    batches.append(lens)
    most = max(max(key.padded_tokens if key else 0 for key in keys), max(sum(b) for b in batches))
    return batches, most


def _batch_shapes(total: int, size: int, shortest: int, longest: int) -> list[list[int]]:
    """Prompt lengths of ``size`` prompts in [shortest, longest] summing to ``total``: equal
    lengths, and one prompt as long as possible (prefill graphs are keyed by the longest)."""
    equal = [total // size + (i < total % size) for i in range(size)]
    if size == 1:
        return [equal]
    top = min(longest, total - (size - 1) * shortest)
    rest = total - top
    skewed = [top] + [rest // (size - 1) + (i < rest % (size - 1)) for i in range(size - 1)]
    return [equal, skewed]


def capture_lanes(
    spec: DecodeSpec, lanes: Sequence[Lane], batches: tuple, beam_width: int, top_k: int
) -> int:
    """Run on every lane the batches ``warm_up_batches`` gives, capturing their graphs
    (``Engine.warm_up``), and one batch of each size again with trie masks allowing every
    path: the decode graphs of batches with item rules (the server's history exclusion
    gives every request some) are others.

    Args:
        spec: the engine's ``DecodeSpec``.
        lanes: the engine's lanes (each with its stream and ``CudaGraphs``).
        batches: (shortest, longest, max_batch_size) of the load (tokens, tokens, requests).
        beam_width, top_k: the load's search parameters.

    Returns:
        graphs captured, all lanes together.
    """
    graphs = [lane.graphs for lane in lanes]
    before = sum(g.captures for g in graphs)
    prompt_lens, most = warm_up_batches(graphs[0], *batches, beam_width, top_k)
    for lane in lanes:
        lane.graphs.reserve(most)  # growing the pool later would drop the graphs
        stream = lane.stream
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            sizes = set()
            for lens in prompt_lens:
                prompts = [[PREFILL_PAD_TOKEN] * n for n in lens]
                generate_semantic_ids(spec, prompts, beam_width, top_k, lane.graphs)
                if len(lens) not in sizes:
                    sizes.add(len(lens))
                    masks = functools.partial(_every_path, spec, len(lens))
                    launch = launch_semantic_ids(
                        spec, prompts, beam_width, top_k, lane.graphs, None, masks
                    )
                    launch.wait()
    torch.cuda.synchronize(graphs[0].model.lm_head.weight.device)
    return sum(g.captures for g in graphs) - before


def capture_ahead(
    spec: DecodeSpec,
    previous: DecodeSpec,
    lanes: Lanes,
    live: Callable[[], Sequence[DecodeSpec]],
    pause: float = CAPTURE_AHEAD_PAUSE,
    recent: float = CAPTURE_AHEAD_RECENT_S,
) -> int:
    """Capture, on every lane, the decode graphs of ``spec`` (a catalog version about to be
    served) that batches over ``previous`` replay, so that the new version's first batches
    replay instead of capturing (``Engine.update_catalog``).

    One batch of padding prompts per graph replayed in the last ``recent`` s, of the
    lengths last seen with its key (with masks allowing every path where the graph reads
    trie masks), each launched alone (a capture holds other launches back,
    ``CaptureGate``); after each, a pause of ``pause`` x its time lets the requests queued
    behind it run before the next.

    Args:
        live: () -> the specs whose graphs a lane keeps; it must include ``spec`` while this
            runs (else another batch's ``CudaGraphs.use`` drops the graphs captured here).

    Returns:
        Graphs captured, all lanes together.
    """
    captured, since = 0, time.monotonic() - recent
    for lane in lanes.lanes:
        graphs = lane.graphs
        if graphs is None:
            continue
        for key, lens in graphs.decode_batches(previous, since):
            if (spec, key) in graphs.cache:
                continue
            prompts = [[PREFILL_PAD_TOKEN] * n for n in lens]
            before = graphs.captures
            masks = functools.partial(_every_path, spec, len(prompts)) if key.filtered else None

            def launch(graphs=graphs, prompts=prompts, key=key, masks=masks):
                with graphs.lock:
                    graphs.use(spec, live())
                    return launch_semantic_ids(
                        spec, prompts, key.beam_width, key.top_k, graphs, None, masks
                    )

            started = time.perf_counter()
            lanes.run(lane, launch, lambda: True).wait()
            took = time.perf_counter() - started
            captured += graphs.captures - before
            time.sleep(pause * took)
    return captured


def _every_path(spec: DecodeSpec, requests: int) -> tuple[torch.Tensor, ...]:
    """Trie masks allowing every path (``CatalogMasks.masks``' form): per level,
    (requests, nodes at depth level + 1) bool."""
    return tuple(
        torch.ones(requests, level.num_children, dtype=torch.bool, device=spec.trie.device)
        for level in spec.trie.levels
    )
