"""The Triton beam step equals the torch reference step on code log-probabilities.

On the CPU the kernels run under Triton's interpreter; on a GPU compiled.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from xgr.beam import step as step_module  # noqa: E402
from xgr.beam.step import BeamState, constrained_beam_step, constrained_beam_step_triton  # noqa: E402
from xgr.catalog import build_prefix_trie  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("layout", ["dense", "csr"])
@pytest.mark.parametrize("pool_topk", ["triton", "xbeam", "torch"])
def test_triton_step_equals_reference(monkeypatch, seed, layout, pool_topk):
    monkeypatch.setattr(step_module, "POOL_TOPK", pool_topk)
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    codebook = int(rng.integers(3, 40))
    sids = np.unique(rng.integers(0, codebook, (int(rng.integers(5, 400)), 3)), axis=0)
    trie = build_prefix_trie(sids, codebook, dense_max_entries=1 << 40 if layout == "dense" else 0)
    depth = int(rng.integers(0, 3))
    level = trie.levels[depth].to(DEVICE)
    assert level.is_dense == (layout == "dense")
    requests, prev = int(rng.integers(1, 4)), int(rng.integers(1, 9))
    nodes = torch.randint(0, level.num_parents, (requests, prev), generator=gen)
    scores = -3 * torch.rand(requests, prev, generator=gen)
    scores[torch.rand(requests, prev, generator=gen) < 0.25] = float("-inf")  # dead beams
    scores = scores.sort(1, descending=True).values
    log_probs = torch.log_softmax(2 * torch.randn(requests, prev, codebook, generator=gen), -1)
    log_probs[0, 0, int(rng.integers(codebook))] = float("nan")  # a broken model output
    state = BeamState(scores, nodes, torch.zeros_like(nodes), torch.zeros_like(nodes))
    on_device = BeamState(*(t.to(DEVICE) for t in (scores, nodes, nodes, nodes)))
    # (1, 3): one beam kept from a pool of several (the top-k keeps 2, writes 1).
    # Item rules: each request its own children allowed (None in some cases).
    allowed = torch.rand(requests, level.num_children, generator=gen) < 0.6
    cases = ((4, 2, None), (8, codebook, allowed), (3 * prev * codebook, 1, None), (1, 3, allowed))
    for beam_width, top_k, rules in cases:
        expected = constrained_beam_step(
            state, log_probs, trie.levels[depth], None, beam_width, top_k, rules
        )
        got = constrained_beam_step_triton(
            on_device, log_probs.to(DEVICE), level, beam_width, top_k,
            None if rules is None else rules.to(DEVICE),
        )  # fmt: skip
        torch.testing.assert_close(got.scores.cpu(), expected.scores)
        live = expected.scores > float("-inf")
        for field in ("nodes", "codes", "parents"):
            g, e = getattr(got, field).cpu(), getattr(expected, field)
            assert g.shape == e.shape == (requests, beam_width)
            assert torch.equal(g[live], e[live]), field
        assert torch.equal(got.nodes.cpu()[~live], torch.zeros_like(expected.nodes[~live]))
