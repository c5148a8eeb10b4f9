"""Triton's chunked top-k of a beam step's pool against a stable descending sort.

On the CPU the kernel runs under Triton's interpreter (small chunks keep it quick); on a GPU
compiled, at the engine's pool sizes too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from xgr.kernels import triton_topk  # noqa: E402
from xgr.kernels.triton_topk import pool_topk, topk_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_pool(rows, n, seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(rows, n, generator=gen) * 5
    if ties:  # few distinct values: the order among equals is tested
        pool = pool.round()
    dead = torch.rand(rows, n, generator=gen) < 0.3
    pool[dead] = float("-inf")
    pool[0, : n // 2] = float("-inf")  # a row mostly dead, as after a sparse level
    return pool.to(DEVICE)


@pytest.mark.parametrize(
    ("rows", "n", "keep", "chunk"),
    [
        (1, 1, 1, 32),
        (2, 37, 1, 32),  # keep 1 of many (the kernel keeps 2)
        (2, 37, 5, 32),  # one round, padded chunk
        (3, 300, 8, 32),  # three rounds of chunks
        (2, 300, 20, 16),  # k (32) above the chunk size: chunks of 2k
        (1, 64, 64, 32),  # keep everything
        (1, 700, 100, 256),  # keep not a power of two
    ],
)
@pytest.mark.parametrize("ties", [False, True])
def test_pool_topk_equals_a_stable_descending_sort(monkeypatch, rows, n, keep, chunk, ties):
    if DEVICE == "cpu":
        monkeypatch.setattr(triton_topk, "TOPK_CHUNK", chunk)
    pool = make_pool(rows, n, seed=n + keep, ties=ties)
    scores, index = pool_topk(pool, keep)
    want_scores, want_index = topk_reference(pool, keep)
    assert scores.shape == index.shape == (rows, keep)
    assert index.dtype == torch.int64
    assert torch.equal(scores, want_scores)
    assert torch.equal(index, want_index)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("tight", [False, True])
def test_a_bound_skips_chunks_and_changes_nothing(monkeypatch, ties, tight):
    """Rows sorted like a beam step's pool (better beams first): with a bound at or below the
    keep-th best, the later chunks are skipped and the winners stay those of a sort."""
    if DEVICE == "cpu":
        monkeypatch.setattr(triton_topk, "TOPK_CHUNK", 32)
    rows, n, keep = 3, 600, 20
    pool = make_pool(rows, n, seed=7, ties=ties).cpu()
    pool = pool - torch.arange(n)[None, :] / 10  # later entries lower: whole chunks below
    pool = pool.to(DEVICE)
    want_scores, want_index = topk_reference(pool, keep)
    kth = want_scores[:, -1]
    bound = kth if tight else kth - 1.0
    bound = torch.where(torch.isinf(kth), kth, bound)  # the mostly dead row: no bound
    scores, index = pool_topk(pool, keep, bound.contiguous())
    assert torch.equal(scores, want_scores) and torch.equal(index, want_index)
    with pytest.raises(ValueError, match="bound must be"):
        pool_topk(pool, keep, bound[:2])


def test_signed_zeros_tie():
    """-0.0 and +0.0 are equal scores: they keep their pool order, as a stable sort does."""
    pool = torch.tensor([[-0.0, 0.0, -0.0, 0.0, -1.0, float("-inf")]], device=DEVICE)
    scores, index = pool_topk(pool, 5)
    assert index.tolist() == [[0, 1, 2, 3, 4]]
    assert torch.equal(scores, topk_reference(pool, 5)[0])


@pytest.mark.skipif(DEVICE == "cpu", reason="engine-size pools are slow under the interpreter")
@pytest.mark.parametrize(("n", "keep"), [(512 * 32, 512), (512 * 256, 512), (256 * 256, 256)])
def test_pool_topk_at_engine_sizes(n, keep):
    pool = make_pool(8, n, seed=n)
    scores, index = pool_topk(pool, keep)
    want_scores, want_index = topk_reference(pool, keep)
    assert torch.equal(scores, want_scores) and torch.equal(index, want_index)


@pytest.mark.parametrize(
    ("pool", "keep", "message"),
    [
        (torch.zeros(2, 8, dtype=torch.float64), 2, "float32"),
        (torch.zeros(8), 2, r"\(R, n\)"),
        (torch.zeros(2, 8), 0, "keep"),
        (torch.zeros(2, 8), 9, "keep"),
    ],
)
def test_bad_pools_are_refused(pool, keep, message):
    with pytest.raises(ValueError, match=message):
        pool_topk(pool.to(DEVICE), keep)
