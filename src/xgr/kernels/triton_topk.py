"""Triton top-k of each request's candidate pool: the selection of a beam step.

``torch.topk`` with k = 512 sorts the whole row for pools under about 64 x k entries, which
is slow for the small pools of a semantic-ID beam step (the root's 256 codes, the last
level's 512 beams x <= 32 children); its radix select wins on the large dense pools.
``benchmarks/selection.py`` times both; ``xgr.beam.step`` picks by pool size
(docs/performance.md).

Here each program takes a chunk of a row, packs every score with its position into one
int64 key and keeps the chunk's top k with Triton's bitonic top-k (``tl.topk``, after
Shanbhag, Pirk and Madden, "Efficient Top-K Query Processing on Massively Parallel
Hardware", SIGMOD 2018); the chunks' winners form the next round's pool until one program
holds a row. Keys order by score, then by lower position, so ties (and -inf, the dead
candidates) resolve as a stable descending sort does: ``topk_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pool entries per program: 4096 int64 keys in registers, and few rounds for 512 x 256 pools.
TOPK_CHUNK = 4096


@triton.jit
def _pool_topk_kernel(
    IN, BOUND, OUT_KEYS, OUT_SCORES, OUT_INDEX,
    n_in, keep, stride_in, stride_out,
    CHUNK: tl.constexpr, K: tl.constexpr, FROM_SCORES: tl.constexpr, FINAL: tl.constexpr,
    HAS_BOUND: tl.constexpr,
):  # fmt: skip
    """Grid: (requests, chunks). Top K keys of IN[r, c * CHUNK : (c + 1) * CHUNK].

    FROM_SCORES: IN holds float32 scores (packed here), else the previous round's keys.
    FINAL: write the first ``keep`` winners unpacked (score, position); else K keys.
    HAS_BOUND: BOUND[r] is a lower bound on the row's keep-th best score; a chunk whose
    every entry is below it cannot hold a winner and is not sorted (K lowest keys out).
    """
    # 64-bit offsets: rows x pool entries may pass 2**31.
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    offs = c * CHUNK + tl.arange(0, CHUNK).to(tl.int64)
    ok = offs < n_in
    if FROM_SCORES:
        score = tl.load(IN + r * stride_in + offs, mask=ok, other=float("-inf"))
        bits = score.to(tl.int32, bitcast=True)
        # Order-preserving: a negative float's magnitude bits flip, so int order = float order.
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        ordered = tl.where(score == 0.0, 0, ordered)  # -0.0 ties with +0.0
        # Lower positions rank first among equal scores (a stable descending sort).
        key = (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - offs)
        # Positions past the pool's end get the int64 minimum: below every real key, -inf too.
        key = tl.where(ok, key, -9223372036854775808)
    else:
        key = tl.load(IN + r * stride_in + offs, mask=ok, other=-9223372036854775808)
    skip = False
    if HAS_BOUND:
        bound = tl.load(BOUND + r)
        bound_bits = bound.to(tl.int32, bitcast=True)
        bound_key = tl.where(bound_bits >= 0, bound_bits, bound_bits ^ 0x7FFFFFFF)
        bound_key = tl.where(bound == 0.0, 0, bound_key)
        skip = tl.max(key >> 32) < bound_key
    if skip:
        best = tl.full([K], -9223372036854775808, tl.int64)
    else:
        best = tl.topk(key, K)  # descending
    i = tl.arange(0, K)
    if FINAL:
        ordered = (best >> 32).to(tl.int32)
        bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
        position = 0xFFFFFFFF - (best & 0xFFFFFFFF)
        tl.store(OUT_SCORES + r * keep + i, bits.to(tl.float32, bitcast=True), mask=i < keep)
        tl.store(OUT_INDEX + r * keep + i, position, mask=i < keep)
    else:
        tl.store(OUT_KEYS + r * stride_out + c * K + i, best)


def pool_topk(
    pool: torch.Tensor, keep: int, bound: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``keep`` best entries of each row, best first, ties to the lower position.

    With ``bound`` this is xBeam's early sorting termination (arXiv:2512.11529): a chunk
    of the pool whose every entry is below the bound holds no winner and skips its sort
    (later rounds skip chunks of only skipped winners). The result is the same as without.

    Args:
        pool: (R, n) float32 scores on a CUDA device (or any device under Triton's
            interpreter); NaN must already be replaced (the beam step scores it -inf).
        keep: 1 <= keep <= n entries per row.
        bound: (R,) float32, for each row a score that at least ``keep`` of its entries
            reach (for instance the keep-th best of any of its entries); None: no bound.

    Returns:
        scores: (R, keep) float32; index: (R, keep) int64 positions in the row.

    Raises:
        ValueError: a pool that is not 2-D float32, keep out of range, or n >= 2**32.
    """
    if pool.dim() != 2 or pool.dtype != torch.float32:
        raise ValueError(f"pool must be (R, n) float32, got {tuple(pool.shape)} {pool.dtype}")
    rows, n = pool.shape
    if not 1 <= keep <= n:
        raise ValueError(f"keep must be in 1..{n}, got {keep}")
    if n >= 2**32:
        raise ValueError(f"pools of {n} entries are beyond the 32-bit positions of the keys")
    if bound is not None and (bound.shape != (rows,) or bound.dtype != torch.float32):
        raise ValueError(f"bound must be ({rows},) float32, got {tuple(bound.shape)} {bound.dtype}")
    pool = pool.contiguous()
    # tl.topk needs k >= 2 (k = 1 reduces to a scalar); keep <= k entries are written.
    k = max(2, triton.next_power_of_2(keep))
    scores = torch.empty(rows, keep, dtype=torch.float32, device=pool.device)
    index = torch.empty(rows, keep, dtype=torch.int64, device=pool.device)
    if rows == 0:
        return scores, index
    src, count, from_scores = pool, n, True
    while True:
        # A chunk holds at least 2k entries, so every round at least halves the pool.
        chunk = max(k, min(max(TOPK_CHUNK, 2 * k), triton.next_power_of_2(count)))
        chunks = triton.cdiv(count, chunk)
        final = chunks == 1
        keys = (
            index if final else torch.empty(rows, chunks * k, dtype=torch.int64, device=pool.device)
        )
        _pool_topk_kernel[(rows, chunks)](
            src, bound if bound is not None else scores, keys, scores, index, count, keep,
            src.stride(0), keys.stride(0),
            CHUNK=chunk, K=k, FROM_SCORES=from_scores, FINAL=final, HAS_BOUND=bound is not None,
            num_warps=8 if chunk >= 2048 else 4,
        )  # fmt: skip
        if final:
            return scores, index
        src, count, from_scores = keys, chunks * k, False


def topk_reference(pool: torch.Tensor, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pool_topk`` by a stable descending sort: (R, keep) scores and int64 positions."""
    scores, index = pool.sort(dim=1, descending=True, stable=True)
    return scores[:, :keep], index[:, :keep]
