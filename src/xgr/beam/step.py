"""One step of catalog-constrained beam search, vectorized over requests and beams.

Candidates of a beam are only the children of its trie node (the valid continuations of
its prefix); each beam keeps its ``top_k`` best, then each request keeps the global
``beam_width`` best of its pool. With top_k >= beam_width this is exactly the selection of
standard beam search over the masked vocabulary (as in HF transformers' ``generate``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.catalog.trie import TrieLevel

NEG_INF = float("-inf")
# How ``constrained_beam_step_triton`` selects each request's pool: "auto" (the measured
# choice below), "triton" (bitonic top-k in chunks), "xbeam" (the same, skipping the chunks
# below an early-termination bound, ``early_termination_bound``) or "torch" (``torch.topk``).
POOL_TOPK = "auto"
POOL_TOPK_MODES = ("auto", "triton", "xbeam", "torch")
# Each beam's best candidates that "xbeam" bounds the winners from (at least; more where the
# request has fewer beams than winners): more give a tighter bound for a larger top-k.
XBEAM_CANDIDATES_PER_BEAM = 1
# "auto" takes torch.topk for pools of at least this many times the beams kept: in
# ``benchmarks/selection.py`` (beams 256 and 512) the Triton top-k won on the smaller pools
# (the root's codes, the last level's few children a beam) and lost to torch.topk's radix
# select on the dense level's, and this ratio separates every measured case
# (docs/performance.md). Beams above 512 are unmeasured.
TORCH_TOPK_MIN_POOL_RATIO = 64


@dataclass
class BeamState:
    """The live beams of a batch after a decode step.

    Attributes:
        scores: (R, B) float32 summed log-probability of each beam; -inf for a dead beam
            (fewer valid paths than beams), sorted best first per request.
        nodes: (R, B) int64 trie node of each beam's prefix at the current depth.
        codes: (R, B) int64 code chosen at this step.
        parents: (R, B) int64 index of each beam's parent among the previous step's beams.
    """

    scores: torch.Tensor
    nodes: torch.Tensor
    codes: torch.Tensor
    parents: torch.Tensor

    @classmethod
    def root(cls, num_requests: int, device: torch.device) -> BeamState:
        """One beam per request at the trie root, score 0."""
        zeros = torch.zeros(num_requests, 1, dtype=torch.int64, device=device)
        return cls(torch.zeros(num_requests, 1, device=device), zeros, zeros, zeros)

    def narrow(self, width: int) -> BeamState:
        """The first ``width`` beams of each request, (R, width) views; itself if it has
        no more."""
        if width >= self.scores.shape[1]:
            return self
        fields = (self.scores, self.nodes, self.codes, self.parents)
        return BeamState(*(t[:, :width] for t in fields))


def constrained_beam_step(
    state: BeamState,
    log_probs: torch.Tensor,
    level: TrieLevel,
    level_token_ids: torch.Tensor | None,
    beam_width: int,
    top_k: int,
    allowed: torch.Tensor | None = None,
) -> BeamState:
    """Extend every beam by one code and keep the best ``beam_width`` per request.

    Runs on the tensors' device with no host synchronization (CUDA-graph safe): masking is
    a gather from the trie level's tables, selection is ``torch.topk``. On CUDA with code
    log-probabilities it runs ``constrained_beam_step_triton``; this torch code is the reference.

    Args:
        state: beams before the step, (R, B_prev) each.
        log_probs: (R, B_prev, vocab_size) float32 next-token log-probabilities of each beam,
            or (R, B_prev, codebook_size) log-probabilities of this level's codes when
            ``level_token_ids`` is None.
        level: the trie level whose children are this step's valid codes.
        level_token_ids: (codebook_size,) int64 vocabulary id of each code of this level
            (any id for codes no item uses: they are never valid candidates); None when
            log_probs is already indexed by code.
        beam_width: beams kept per request.
        top_k: candidates each beam contributes to its request's pool.
        allowed: (R, level.num_children) bool, the children each request may take (its item
            rules, ``xgr.catalog.rules.CatalogMasks``); None: every child.

    Returns:
        The new beams, (R, beam_width) each, best first; rows beyond the number of valid
        candidates have score -inf.
    """
    if log_probs.is_cuda and level_token_ids is None:
        return constrained_beam_step_triton(state, log_probs, level, beam_width, top_k, allowed)
    num_requests, prev_beams, vocab = log_probs.shape
    codes, children, valid = level.expand(state.nodes.reshape(-1))  # [R * B_prev, W]
    width = codes.shape[1]
    if level_token_ids is None:
        index = codes.clamp(0, vocab - 1)
    else:
        index = level_token_ids[codes].clamp(0, vocab - 1)
    cand = log_probs.reshape(-1, vocab).gather(1, index) + state.scores.reshape(-1, 1)
    # NaN (a numerically broken model) must not win a place: such candidates are dropped.
    cand = cand.masked_fill(~valid | torch.isnan(cand), NEG_INF)
    cand = _mask_children(cand, children, allowed)
    if top_k >= width:
        # Every candidate of a beam may enter the pool: one top-k over the request's pool
        # selects the same beams without first sorting each beam's candidates.
        k, beam_slot = width, None
        pool = cand.view(num_requests, prev_beams * width)
    else:
        k = top_k
        beam_best, beam_slot = cand.topk(k, dim=1)  # [R * B_prev, k]
        pool = beam_best.view(num_requests, prev_beams * k)
    keep = min(beam_width, prev_beams * k)
    scores, flat = pool.topk(keep, dim=1)  # [R, keep]
    parents = torch.div(flat, k, rounding_mode="floor")
    if beam_slot is None:
        slot = flat - parents * k
    else:
        slot = beam_slot.view(num_requests, prev_beams * k).gather(1, flat)
    rows = parents + torch.arange(num_requests, device=parents.device)[:, None] * prev_beams
    new_codes = codes[rows, slot]
    new_nodes = children[rows, slot]
    alive = scores > NEG_INF
    state = BeamState(
        scores,
        torch.where(alive, new_nodes, 0),
        torch.where(alive, new_codes, 0),
        parents,
    )
    return _pad_beams(state, beam_width)


def constrained_beam_step_triton(
    state: BeamState,
    log_probs: torch.Tensor,
    level: TrieLevel,
    beam_width: int,
    top_k: int,
    allowed: torch.Tensor | None = None,
) -> BeamState:
    """``constrained_beam_step`` on code log-probabilities with Triton kernels.

    One kernel scores every beam's candidates (trie lookup, gather, the item rules' mask),
    the request's pool is selected as ``POOL_TOPK`` says (Triton's bitonic top-k in chunks,
    ``xgr.kernels.triton_topk.pool_topk``, for pools under 64 x the beams kept, else
    ``torch.topk`` unsorted, its winners then ordered by ``pool_topk``), one kernel resolves
    the winners' parents, codes and trie nodes. Same arguments and result as
    ``constrained_beam_step`` with ``level_token_ids=None`` (the order among exactly equal
    scores is the top-k's: the lower pool position first for the Triton one, unspecified for
    ``torch.topk``); (R, B_prev, codebook_size) float32 ``log_probs`` with a contiguous last
    dimension.

    Raises:
        ValueError: ``POOL_TOPK`` is none of ``POOL_TOPK_MODES``.
    """
    from xgr.kernels.triton_beam import gather_selected, score_candidates
    from xgr.kernels.triton_topk import pool_topk

    num_requests, prev_beams, num_codes = log_probs.shape
    nodes = state.nodes.reshape(-1)
    cand = score_candidates(
        log_probs.reshape(-1, num_codes), nodes, state.scores.reshape(-1), level, allowed
    )
    width = cand.shape[1]
    if top_k >= width:
        k, slot = width, None
        pool = cand.view(num_requests, prev_beams * width)
    else:
        k = top_k
        beam_best, slot = cand.topk(k, dim=1)
        pool = beam_best.view(num_requests, prev_beams * k)
    keep = min(beam_width, prev_beams * k)
    if POOL_TOPK not in POOL_TOPK_MODES:
        raise ValueError(f"POOL_TOPK must be one of {POOL_TOPK_MODES}, got {POOL_TOPK!r}")
    use_triton = POOL_TOPK == "triton" or (
        POOL_TOPK == "auto" and pool.shape[1] < TORCH_TOPK_MIN_POOL_RATIO * keep
    )
    if POOL_TOPK == "xbeam" and prev_beams > 1:
        bound = early_termination_bound(
            cand if slot is None else beam_best, num_requests, keep, XBEAM_CANDIDATES_PER_BEAM
        )
        scores, flat = pool_topk(pool, keep, bound)
    elif use_triton or POOL_TOPK == "xbeam":
        scores, flat = pool_topk(pool, keep)
    else:
        # The winners unsorted, then ordered by the bitonic kernel: torch's own ordering (a
        # radix sort of the winners) was about a third of the dense level's step, and the
        # bitonic sort of only the winners is cheaper (docs/performance.md).
        scores, flat = pool.topk(keep, dim=1, sorted=False)
        scores, order = pool_topk(scores, keep)
        flat = flat.gather(1, order)
    new_nodes, codes, parents = gather_selected(flat, slot, scores, nodes, level, k)
    return _pad_beams(BeamState(scores, new_nodes, codes, parents), beam_width)


def early_termination_bound(
    candidates: torch.Tensor, num_requests: int, keep: int, per_beam: int = 1
) -> torch.Tensor:
    """A lower bound on each request's ``keep``-th best candidate, from each beam's best
    (xBeam's early sorting termination: Sun et al., "xGR: Efficient Generative
    Recommendation Serving at Scale", arXiv:2512.11529).

    The ``keep``-th best among any ``keep`` or more of a request's candidates is reached by
    at least ``keep`` of them, so the request's ``keep`` winners all reach it. The subset
    taken is each beam's ``c = ceil(keep / beams)`` best candidates (its best alone when the
    request has at least ``keep`` beams), or ``per_beam`` where that is more.

    Args:
        candidates: (R * beams, W) float32 scores of each beam's candidates (-inf: none),
            request-major.
        num_requests: R.
        keep: winners per request, 1 <= keep <= beams * W.
        per_beam: candidates taken from each beam at least (at most W are).

    Returns:
        (R,) float32 bound (-inf where fewer than ``keep`` candidates are valid).
    """
    beams = candidates.shape[0] // num_requests
    per_beam = min(max(-(-keep // beams), per_beam), candidates.shape[1])
    if per_beam == 1:
        best = candidates.amax(dim=1)
    else:
        best = candidates.topk(per_beam, dim=1, sorted=False).values
    best = best.reshape(num_requests, -1)
    # The keep-th largest is the (n - keep + 1)-th smallest.
    return best.kthvalue(best.shape[1] - keep + 1, dim=1).values


def _mask_children(
    cand: torch.Tensor, children: torch.Tensor, allowed: torch.Tensor | None
) -> torch.Tensor:
    """-inf for the candidates whose child node the request may not take.

    Args:
        cand: (R * B_prev, W) float32 candidate scores.
        children: (R * B_prev, W) int64 child node of each candidate (in range).
        allowed: (R, num_children) bool, or None (``cand`` returned as it is).
    """
    if allowed is None:
        return cand
    ok = allowed.gather(1, children.reshape(allowed.shape[0], -1)).view_as(cand)
    return cand.masked_fill(~ok, NEG_INF)


def _pad_beams(state: BeamState, beam_width: int) -> BeamState:
    """Pad to ``beam_width`` dead beams (score -inf, node 0, parent 0) so shapes stay fixed."""
    missing = beam_width - state.scores.shape[1]
    if missing == 0:
        return state
    rows = state.scores.shape[0]
    pad_scores = torch.full((rows, missing), NEG_INF, device=state.scores.device)
    pad_ints = torch.zeros(rows, missing, dtype=torch.int64, device=state.scores.device)
    return BeamState(
        torch.cat([state.scores, pad_scores], 1),
        torch.cat([state.nodes, pad_ints], 1),
        torch.cat([state.codes, pad_ints], 1),
        torch.cat([state.parents, pad_ints], 1),
    )
