"""The batches a warm-up runs so that a load's CUDA graphs exist before the load, and
their run on every lane."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch

from xgr.engine.cuda_graph import CudaGraphs
from xgr.engine.generate import generate_semantic_ids
from xgr.engine.inputs import PREFILL_PAD_TOKEN
from xgr.engine.lanes import Lane
from xgr.engine.spec import DecodeSpec

# Prompt totals are stepped this finely (tokens): finer than any prefill bucket.
TOTAL_STEP = 32


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
    (``Engine.warm_up``).

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
            for lens in prompt_lens:
                prompts = [[PREFILL_PAD_TOKEN] * n for n in lens]
                generate_semantic_ids(spec, prompts, beam_width, top_k, lane.graphs)
    torch.cuda.synchronize(graphs[0].model.lm_head.weight.device)
    return sum(g.captures for g in graphs) - before
