"""Triton kernels for the constrained beam step: candidate scoring and selected-beam gathering.

The torch step (``xgr.beam.step.constrained_beam_step``) builds each beam's candidates in
about fifteen small kernels (trie lookups, gathers, masks) and resolves the winners in ten
more; inside a CUDA graph each is a node of a few microseconds, so at beam width 512 the
nodes' fixed cost, not the work, set the step's time. Here the candidates come from one
kernel and the winners from another, with the pool's top-k between them (``triton_topk``
or ``torch.topk``); the torch step stays the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG_INF = float("-inf")


@triton.jit
def _score_candidates_kernel(
    LOGP, NODES, SCORES, TABLE, ROW_PTR, CHILD_CODE, ALLOWED, CAND,
    stride_lp, num_parents, num_codes, width, beams_per_request, num_children,
    DENSE: tl.constexpr, HAS_ALLOWED: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = j < width
    node = tl.minimum(tl.maximum(tl.load(NODES + n), 0), num_parents - 1)
    base = tl.load(SCORES + n)
    if DENSE:
        child = tl.load(TABLE + node * width + j, mask=in_row, other=-1)
        valid = child >= 0
        code = j
    else:
        start = tl.load(ROW_PTR + node)
        end = tl.load(ROW_PTR + node + 1)
        valid = in_row & (start + j < end)
        code = tl.load(CHILD_CODE + start + j, mask=valid, other=0)
        child = start + j
    if HAS_ALLOWED:  # the request's item rules: only children with a passing item
        request = (n // beams_per_request).to(tl.int64)
        ok = tl.load(ALLOWED + request * num_children + child, mask=valid, other=0)
        valid = valid & (ok != 0)
    code = tl.minimum(tl.maximum(code, 0), num_codes - 1)
    lp = tl.load(LOGP + n * stride_lp + code, mask=valid, other=0.0)
    cand = lp + base
    # NaN (a numerically broken model) and invalid paths never win a place.
    cand = tl.where(valid & (cand == cand), cand, float("-inf"))
    tl.store(CAND + n * width + j, cand, mask=in_row)


def score_candidates(
    log_probs: torch.Tensor,
    nodes: torch.Tensor,
    scores: torch.Tensor,
    level,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Score of every candidate of every beam: its code's log-probability plus the beam's.

    Args:
        log_probs: (N, codebook_size) float32 log-probabilities of the level's codes.
        nodes: (N,) int64 trie node of each beam. scores: (N,) float32 beam scores.
        level: the ``TrieLevel`` (dense table or CSR) on the same device.
        allowed: (R, level.num_children) bool, the children each request may take, the N
            beams request-major (N / R each); None: every child.

    Returns:
        (N, level.width) float32; -inf for invalid or disallowed candidates and NaN scores.
    """
    log_probs, nodes, scores = log_probs.contiguous(), nodes.contiguous(), scores.contiguous()
    rows, num_codes = log_probs.shape
    width = level.width
    cand = torch.empty(rows, width, dtype=torch.float32, device=log_probs.device)
    block = min(1024, triton.next_power_of_2(width))
    dense = level.child_table is not None
    table = level.child_table if dense else level.row_ptr
    row_ptr = level.row_ptr if not dense else table
    child_code = level.child_code if not dense else table
    per_request = rows // allowed.shape[0] if allowed is not None else 1
    if allowed is not None:
        allowed = allowed.contiguous().view(torch.uint8)  # bool as bytes for the kernel
    if rows:
        _score_candidates_kernel[(rows, triton.cdiv(width, block))](
            log_probs, nodes, scores, table, row_ptr, child_code,
            allowed if allowed is not None else nodes, cand,
            log_probs.stride(0), level.num_parents, num_codes, width, per_request,
            level.num_children, DENSE=dense, HAS_ALLOWED=allowed is not None, BLOCK=block,
        )  # fmt: skip
    return cand


@triton.jit
def _gather_selected_kernel(
    FLAT, SLOT, SCORES, NODES, TABLE, ROW_PTR, CHILD_CODE,
    OUT_NODES, OUT_CODES, OUT_PARENTS,
    keep, prev_beams, k, width, num_parents,
    PER_BEAM: tl.constexpr, DENSE: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = i < keep
    flat = tl.load(FLAT + r * keep + i, mask=ok, other=0)
    parent = flat // k
    if PER_BEAM:  # the pool held each beam's top-k: map back to the candidate column
        col = tl.load(SLOT + (r * prev_beams + parent) * k + flat % k, mask=ok, other=0)
    else:
        col = flat % k
    row = r * prev_beams + parent
    node = tl.minimum(tl.maximum(tl.load(NODES + row, mask=ok, other=0), 0), num_parents - 1)
    # A dead beam's column may be no child at all: nothing is read for it.
    alive = tl.load(SCORES + r * keep + i, mask=ok, other=float("-inf")) > float("-inf")
    live = ok & alive
    if DENSE:
        code = col
        child = tl.load(TABLE + node * width + col, mask=live, other=0).to(tl.int64)
    else:
        idx = tl.load(ROW_PTR + node, mask=live, other=0) + col
        code = tl.load(CHILD_CODE + idx, mask=live, other=0)
        child = idx
    tl.store(OUT_NODES + r * keep + i, tl.where(alive, child, 0), mask=ok)
    tl.store(OUT_CODES + r * keep + i, tl.where(alive, code, 0), mask=ok)
    tl.store(OUT_PARENTS + r * keep + i, parent, mask=ok)


def gather_selected(
    flat: torch.Tensor,
    slot: torch.Tensor | None,
    scores: torch.Tensor,
    nodes: torch.Tensor,
    level,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Parents, codes and child nodes of the selected candidates.

    Args:
        flat: (R, keep) int64 positions of the winners in each request's pool of
            prev_beams * k candidates. slot: (R * prev_beams, k) int64 candidate column of
            each pool entry when the pool holds per-beam top-k, else None (pool = all columns).
        scores: (R, keep) float32 winners' scores (-inf: dead beam).
        nodes: (R * prev_beams,) int64 trie node of each previous beam.
        level: the ``TrieLevel``. k: pool entries per beam.

    Returns:
        nodes, codes, parents: (R, keep) int64 each; node and code 0 for dead beams.
    """
    num_requests, keep = flat.shape
    prev_beams = nodes.shape[0] // max(num_requests, 1)
    out = [torch.empty_like(flat) for _ in range(3)]
    dense = level.child_table is not None
    table = level.child_table if dense else level.row_ptr
    row_ptr = level.row_ptr if not dense else table
    child_code = level.child_code if not dense else table
    block = min(1024, triton.next_power_of_2(keep))
    if flat.numel():
        _gather_selected_kernel[(num_requests, triton.cdiv(keep, block))](
            flat, slot if slot is not None else flat, scores, nodes, table, row_ptr, child_code,
            *out, keep, prev_beams, k, level.width, level.num_parents,
            PER_BEAM=slot is not None, DENSE=dense, BLOCK=block,
        )  # fmt: skip
    return tuple(out)
