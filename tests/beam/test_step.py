"""One constrained beam step against a brute-force enumeration of valid continuations."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xgr.beam import BeamState, constrained_beam_step
from xgr.catalog import build_prefix_trie

NEG_INF = -math.inf
DENSE = 1 << 62
CSR = 0


def distinct_sids(rng: np.random.Generator, num: int, num_levels: int, codebook: int):
    return np.unique(rng.integers(0, codebook, size=(num, num_levels)), axis=0)


def continuations(sids: np.ndarray, depth: int) -> dict[int, list[tuple[int, int]]]:
    """Brute force: depth-`depth` node id -> [(code, child node id)], nodes numbered in
    lexicographic order of their prefixes."""
    rows = [tuple(r) for r in sids.tolist()]
    parents = sorted({r[:depth] for r in rows})
    children = sorted({r[: depth + 1] for r in rows})
    parent_id = {p: i for i, p in enumerate(parents)}
    out: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(parents))}
    for child_id, child in enumerate(children):
        out[parent_id[child[:depth]]].append((child[depth], child_id))
    return out


def brute_force_step(state, log_probs, cont, token_of_code, beam_width, top_k):
    """Per request: [(score, parent, code, child)] best first, at most beam_width."""
    results = []
    for r in range(state.scores.shape[0]):
        pool = []
        for b in range(state.scores.shape[1]):
            if state.scores[r, b].item() == NEG_INF:
                continue  # a dead beam has no candidates
            node = int(state.nodes[r, b])
            cands = [
                ((state.scores[r, b] + log_probs[r, b, token_of_code[code]]).item(), b, code, child)
                for code, child in cont[node]
            ]
            cands.sort(key=lambda c: -c[0])
            pool += cands[:top_k]
        pool.sort(key=lambda c: -c[0])
        results.append(pool[:beam_width])
    return results


def assert_state_matches(new, expected, beam_width, prev_beams):
    assert new.scores.shape == new.nodes.shape == new.codes.shape == new.parents.shape
    assert new.scores.shape == (len(expected), beam_width)
    assert new.scores.dtype == torch.float32
    assert new.nodes.dtype == new.codes.dtype == new.parents.dtype == torch.int64
    for r, beams in enumerate(expected):
        got = [
            (
                new.scores[r, i].item(),
                int(new.parents[r, i]),
                int(new.codes[r, i]),
                int(new.nodes[r, i]),
            )
            for i in range(len(beams))
        ]
        assert got == beams, r
        for i in range(len(beams), beam_width):  # padding: dead beams at node 0
            assert new.scores[r, i].item() == NEG_INF
            assert int(new.nodes[r, i]) == 0
            assert int(new.codes[r, i]) == 0
            assert 0 <= int(new.parents[r, i]) < prev_beams


def random_setup(rng, num_levels, codebook, num_sids, depth, layout):
    sids = distinct_sids(rng, num_sids, num_levels, codebook)
    trie = build_prefix_trie(sids, codebook, dense_max_entries=layout)
    level = trie.levels[depth]
    vocab = codebook + 11
    token_of_code = rng.permutation(vocab)[:codebook]  # distinct vocabulary id per code
    return sids, level, torch.tensor(token_of_code, dtype=torch.int64), vocab


@settings(max_examples=80, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    layout=st.sampled_from([DENSE, CSR]),
    num_levels=st.integers(1, 3),
    codebook=st.integers(2, 7),
    num_sids=st.integers(1, 60),
    num_requests=st.integers(1, 3),
    prev_beams=st.integers(1, 6),
    beam_width=st.integers(1, 12),
    top_k=st.one_of(st.integers(1, 3), st.integers(1, 12)),  # often below beam_width
    dead_fraction=st.sampled_from([0.0, 0.3]),
)
def test_step_matches_brute_force(
    seed,
    layout,
    num_levels,
    codebook,
    num_sids,
    num_requests,
    prev_beams,
    beam_width,
    top_k,
    dead_fraction,
):
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    depth = int(rng.integers(0, num_levels))
    sids, level, token_ids, vocab = random_setup(rng, num_levels, codebook, num_sids, depth, layout)
    nodes = torch.randint(0, level.num_parents, (num_requests, prev_beams), generator=gen)
    scores = -3 * torch.rand(num_requests, prev_beams, generator=gen)
    scores[torch.rand(num_requests, prev_beams, generator=gen) < dead_fraction] = NEG_INF
    state = BeamState(
        scores,
        nodes,
        torch.zeros_like(nodes),
        torch.zeros_like(nodes),
    )
    log_probs = torch.log_softmax(
        2 * torch.randn(num_requests, prev_beams, vocab, generator=gen), dim=-1
    )
    new = constrained_beam_step(state, log_probs, level, token_ids, beam_width, top_k)
    cont = continuations(sids, depth)
    expected = brute_force_step(state, log_probs, cont, token_ids.tolist(), beam_width, top_k)
    assert_state_matches(new, expected, beam_width, prev_beams)
    # Every live beam is a valid continuation of its parent's node, and no parent gives
    # more than top_k children.
    for r in range(num_requests):
        alive = [i for i in range(beam_width) if new.scores[r, i].item() > NEG_INF]
        for i in alive:
            parent = int(new.parents[r, i])
            pair = (int(new.codes[r, i]), int(new.nodes[r, i]))
            assert pair in cont[int(nodes[r, parent])]
        counts = Counter(int(new.parents[r, i]) for i in alive)
        assert all(n <= top_k for n in counts.values())
        # Scores best first.
        s = new.scores[r].tolist()
        assert s == sorted(s, reverse=True)


@pytest.mark.parametrize("layout", [DENSE, CSR])
def test_step_from_root(layout):
    rng = np.random.default_rng(0)
    sids = distinct_sids(rng, 40, 3, 9)
    trie = build_prefix_trie(sids, 9, dense_max_entries=layout)
    token_ids = torch.arange(9) + 5
    state = BeamState.root(2, torch.device("cpu"))
    assert state.scores.shape == state.nodes.shape == (2, 1)
    assert state.scores.dtype == torch.float32 and state.nodes.dtype == torch.int64
    assert state.scores.tolist() == [[0.0], [0.0]] and state.nodes.tolist() == [[0], [0]]
    log_probs = torch.log_softmax(torch.randn(2, 1, 20), dim=-1)
    new = constrained_beam_step(state, log_probs, trie.levels[0], token_ids, 4, 4)
    first_codes = sorted(set(sids[:, 0].tolist()))
    for r in range(2):
        ranked = sorted(first_codes, key=lambda c: -log_probs[r, 0, c + 5].item())[:4]
        got = new.codes[r, : len(ranked)].tolist()
        assert got == ranked
        assert new.parents[r, : len(ranked)].tolist() == [0] * len(ranked)
        assert new.nodes[r, : len(ranked)].tolist() == [first_codes.index(c) for c in ranked]
        assert new.scores[r, : len(ranked)].tolist() == [
            log_probs[r, 0, c + 5].item() for c in ranked
        ]


@pytest.mark.parametrize("layout", [DENSE, CSR])
def test_fewer_candidates_than_beam_width_pads_with_dead_beams(layout):
    # Two first-level codes only: from the root (1 beam, top_k 8) the pool has 2 live
    # candidates; the 6 other rows are padding.
    sids = np.array([[1, 0], [1, 2], [3, 1]])
    trie = build_prefix_trie(sids, 4, dense_max_entries=layout)
    log_probs = torch.log_softmax(torch.randn(1, 1, 4), dim=-1)
    new = constrained_beam_step(
        BeamState.root(1, torch.device("cpu")), log_probs, trie.levels[0], torch.arange(4), 8, 8
    )
    assert new.scores.shape == (1, 8)
    assert sorted(new.codes[0, :2].tolist()) == [1, 3]
    assert torch.all(new.scores[0, :2] > NEG_INF)
    assert new.scores[0, 2:].tolist() == [NEG_INF] * 6
    assert new.nodes[0, 2:].tolist() == [0] * 6
    assert new.codes[0, 2:].tolist() == [0] * 6


@pytest.mark.parametrize("layout", [DENSE, CSR])
def test_dead_rows_from_a_full_pool_have_node_zero(layout):
    # 4 beams on nodes with one child each (node 4, unused, has 3 so the CSR width is 3),
    # top_k 3 -> a pool of 12 of which only 4 are live; beam width 6 selects 2 dead (-inf)
    # candidates from the pool, which must come back at node 0 with code 0.
    sids = np.array([[0, 3], [1, 2], [2, 1], [3, 0], [4, 0], [4, 1], [4, 2]])
    level = build_prefix_trie(sids, 5, dense_max_entries=layout).levels[1]
    assert level.width == (5 if layout == DENSE else 3)
    state = BeamState(
        torch.tensor([[-1.0, -2.0, -3.0, -4.0]]),
        torch.tensor([[3, 2, 1, 0]]),
        torch.zeros(1, 4, dtype=torch.int64),
        torch.zeros(1, 4, dtype=torch.int64),
    )
    log_probs = torch.full((1, 4, 5), math.log(0.2))
    new = constrained_beam_step(state, log_probs, level, torch.arange(5), 6, 3)
    lp = math.log(0.2)
    assert new.scores[0, :4].tolist() == pytest.approx([-1 + lp, -2 + lp, -3 + lp, -4 + lp])
    assert new.parents[0, :4].tolist() == [0, 1, 2, 3]
    assert new.codes[0, :4].tolist() == [0, 1, 2, 3]
    assert new.nodes[0, :4].tolist() == [3, 2, 1, 0]
    assert new.scores[0, 4:].tolist() == [NEG_INF, NEG_INF]
    assert new.nodes[0, 4:].tolist() == [0, 0]
    assert new.codes[0, 4:].tolist() == [0, 0]


@pytest.mark.parametrize("layout", [DENSE, CSR])
def test_top_k_limits_children_per_parent(layout):
    # Parent 0 is far better than parent 1, so without the limit all 6 beams would be its
    # children; top_k 2 keeps 2 of them and fills the rest from parent 1.
    sids = np.array([[0, c] for c in range(6)] + [[1, c] for c in range(6)])
    level = build_prefix_trie(sids, 6, dense_max_entries=layout).levels[1]
    state = BeamState(
        torch.tensor([[0.0, -10.0]]),
        torch.tensor([[0, 1]]),
        torch.zeros(1, 2, dtype=torch.int64),
        torch.zeros(1, 2, dtype=torch.int64),
    )
    gen = torch.Generator().manual_seed(0)
    log_probs = torch.log_softmax(torch.randn(1, 2, 6, generator=gen), dim=-1)
    new = constrained_beam_step(state, log_probs, level, torch.arange(6), 4, 2)
    assert new.parents[0].tolist() == [0, 0, 1, 1]
    top0 = log_probs[0, 0].argsort(descending=True)[:2].tolist()
    top1 = log_probs[0, 1].argsort(descending=True)[:2].tolist()
    assert new.codes[0].tolist() == top0 + top1
    assert new.nodes[0].tolist() == top0 + [6 + c for c in top1]
    unlimited = constrained_beam_step(state, log_probs, level, torch.arange(6), 4, 6)
    assert unlimited.parents[0].tolist() == [0, 0, 0, 0]


def test_only_valid_codes_even_when_invalid_tokens_are_likelier():
    # The model puts nearly all mass on codes no item uses at this node.
    sids = np.array([[0, 1], [0, 4], [2, 0]])
    for layout in (DENSE, CSR):
        level = build_prefix_trie(sids, 5, dense_max_entries=layout).levels[1]
        state = BeamState(
            torch.tensor([[0.0, -0.5]]),
            torch.tensor([[0, 1]]),
            torch.zeros(1, 2, dtype=torch.int64),
            torch.zeros(1, 2, dtype=torch.int64),
        )
        logits = torch.tensor([[[9.0, 0.0, 9.0, 9.0, 0.5], [0.0, 9.0, 9.0, 9.0, 9.0]]])
        new = constrained_beam_step(
            state, torch.log_softmax(logits, -1), level, torch.arange(5), 5, 5
        )
        alive = int((new.scores[0] > NEG_INF).sum())
        assert alive == 3
        got = set(zip(new.parents[0, :3].tolist(), new.codes[0, :3].tolist(), strict=True))
        assert got == {(0, 1), (0, 4), (1, 0)}
        assert new.scores[0, 3:].tolist() == [NEG_INF, NEG_INF]


@pytest.mark.parametrize("layout", [DENSE, CSR])
def test_full_search_finds_every_semantic_id_ranked(layout):
    # With beam_width >= number of semantic IDs and top_k >= codebook, beam search over all
    # levels is exhaustive: the final beams are all semantic IDs sorted by total score.
    rng = np.random.default_rng(1)
    codebook, num_levels = 4, 3
    sids = distinct_sids(rng, 30, num_levels, codebook)
    trie = build_prefix_trie(sids, codebook, dense_max_entries=layout)
    vocab = codebook * num_levels
    gen = torch.Generator().manual_seed(1)
    table = torch.log_softmax(torch.randn(vocab**num_levels, vocab, generator=gen), dim=-1)

    def log_prob_row(prefix):  # a deterministic "model": next-token log-probs of a prefix
        key = 0
        for token in prefix:
            key = key * vocab + token + 1
        return table[key % table.shape[0]]

    beam_width = len(sids)
    state = BeamState.root(1, torch.device("cpu"))
    prefixes = [()]
    for depth, level in enumerate(trie.levels):
        token_ids = torch.arange(codebook) + depth * codebook
        log_probs = torch.stack(
            [log_prob_row([d * codebook + c for d, c in enumerate(p)]) for p in prefixes]
        )[None]
        state = constrained_beam_step(state, log_probs, level, token_ids, beam_width, codebook)
        prefixes = [
            prefixes[p] + (c,)
            for p, c in zip(state.parents[0].tolist(), state.codes[0].tolist(), strict=True)
        ]
    assert torch.all(state.scores > NEG_INF)
    assert [sids[n].tolist() for n in state.nodes[0].tolist()] == [list(p) for p in prefixes]

    def total(row):
        return sum(
            log_prob_row([d * codebook + c for d, c in enumerate(row[:d])])[
                d * codebook + row[d]
            ].item()
            for d in range(num_levels)
        )

    expected = sorted((tuple(r) for r in sids.tolist()), key=lambda r: -total(r))
    assert prefixes == expected
    torch.testing.assert_close(
        state.scores[0], torch.tensor([total(r) for r in expected]), rtol=0, atol=1e-5
    )


@pytest.mark.parametrize("seed", range(8))
def test_early_termination_bound_is_reached_by_the_winners(seed):
    from xgr.beam.step import early_termination_bound

    gen = torch.Generator().manual_seed(seed)
    requests, beams, width = 3, int(torch.randint(1, 20, (1,), generator=gen)), 7
    cand = torch.randn(requests * beams, width, generator=gen)
    cand[torch.rand(cand.shape, generator=gen) < 0.4] = float("-inf")
    keeps = sorted({1, beams, 2 * beams + 1, beams * width})
    for keep, per_beam in itertools.product(keeps, (1, 3)):
        bound = early_termination_bound(cand, requests, keep, per_beam)
        kth = cand.view(requests, -1).topk(keep, dim=1).values[:, -1]
        assert bound.shape == (requests,)
        assert torch.all(bound <= kth), (keep, bound, kth)
        # A single beam's candidates are the whole pool: the bound is exact.
        if beams == 1:
            assert torch.equal(bound, kth)
