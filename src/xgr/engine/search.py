"""The search of a prefilled batch: every level's constrained selection around one decode
forward per later level, for any model family (``search_levels``). No host synchronization:
a CUDA graph captures it whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.beam import BeamState, constrained_beam_step
from xgr.catalog.trie import PrefixTrie
from xgr.engine.spec import DecodeSpec
from xgr.runner import LevelBatch, Prefilled


@dataclass(frozen=True)
class Searched:
    """The final beams of a searched batch, best first per request.

    Attributes:
        nodes: (R, beam_width) int64 semantic-ID row of each beam.
        scores: (R, beam_width) float32 summed log-probabilities (-inf: no valid path).
        level_scores: (R, beam_width, num_levels) float32 log-probability of each level's
            code; summed in level order in float32 they give ``scores`` exactly. A dead
            beam's (score -inf) are undefined.
    """

    nodes: torch.Tensor
    scores: torch.Tensor
    level_scores: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(nodes, scores, level_scores)."""
        return self.nodes, self.scores, self.level_scores


def search_levels(
    spec: DecodeSpec,
    batch: LevelBatch,
    prefilled: Prefilled,
    beam_width: int,
    top_k: int,
    together: bool,
) -> Searched:
    """Every level's selection and decode forward for a prefilled batch.

    The runner's first step gives level 0's rows (and level 1's, where its forward ran in
    the pass before: ``together``); each later level ``l`` runs the runner's forward on the
    first ``live_beam_widths(...)[l - 1]`` beams of each request (W rows a request,
    request-major), scores the level's codes (``CodeScorer``) and selects within the
    catalog's trie (``constrained_beam_step``). Each forward writes its slot at those
    compact rows, so the reorder before the next level points each beam at its parent's row
    in the previous level's layout, an index update with no KV copy.

    Args:
        spec: runner, scorer and trie.
        batch: the batch's prompt KV and offsets.
        prefilled: the prefill's output.
        beam_width, top_k: search parameters.
        together: level 1's forward runs in the first step
            (``ModelRunner.first_levels_together``).

    Each beam's level scores follow it: the parents' rows are gathered and the new code's
    log-probability, read from the level's scores at (parent, code), appended.

    Returns:
        The final beams (``Searched``).
    """
    first = spec.runner.first_step(batch, prefilled, beam_width, together)
    log_probs = spec.scorer.log_probs_of_levels(list(first.rows))
    if len(log_probs) == 1:
        state = _level_zero(spec, log_probs[0], beam_width, top_k, batch.allowed_at(0))
        history = _code_scores(log_probs[0][:, None, :], state)[..., None]
    else:
        state = _level_one_after_every_code(
            spec, *log_probs, beam_width, top_k, batch.allowed_at(1)
        )
        first_scores = log_probs[0][:, spec.first_codes].gather(1, state.parents)
        level_one = log_probs[1].view(batch.num_requests, spec.first_codes.shape[0], -1)
        history = torch.stack([first_scores, _code_scores(level_one, state)], dim=2)
    widths = live_beam_widths(spec.trie, beam_width, top_k)[len(log_probs) - 1 :]
    beam, num_levels = first.beam, len(spec.trie.levels)
    num_requests = batch.num_requests
    requests = torch.arange(num_requests, device=state.scores.device)[:, None]
    stride, offset = first.parent_stride, first.parent_offset
    for level, width in zip(range(num_levels - len(widths), num_levels), widths, strict=True):
        live = state.narrow(width)
        if beam.length:  # each beam inherits its parent's written slots
            beam.reorder((live.parents + requests * stride + offset).reshape(-1))
        ids = spec.scorer.code_tokens(level - 1, live.codes)
        hidden = spec.runner.forward_level(batch, beam, ids.reshape(-1), level, width)
        beam.length += 1
        scores = spec.scorer.log_probs(hidden, level).view(num_requests, width, -1)
        trie_level, allowed = spec.trie.levels[level], batch.allowed_at(level)
        state = constrained_beam_step(live, scores, trie_level, None, beam_width, top_k, allowed)
        inherited = history.gather(1, state.parents[..., None].expand(-1, -1, history.shape[2]))
        history = torch.cat([inherited, _code_scores(scores, state)[..., None]], dim=2)
        stride, offset = width, 0
    return Searched(state.nodes, state.scores, history)


def _code_scores(log_probs: torch.Tensor, state: BeamState) -> torch.Tensor:
    """(R, B) float32 log-probability of each new beam's code under its parent: ``log_probs``
    (R, P, C) at (parent, code); -inf for a dead beam."""
    num_requests, parents, codes = log_probs.shape
    flat = log_probs.reshape(num_requests, parents * codes)
    picked = flat.gather(1, state.parents * codes + state.codes)
    return picked.masked_fill(state.scores == float("-inf"), float("-inf"))


def _level_zero(
    spec: DecodeSpec, log_probs: torch.Tensor, beam_width: int, top_k: int, allowed=None
) -> BeamState:
    """Level 0's selection: the root is every beam's common parent and alone supplies the
    first ``beam_width`` beams from its children ((R, codebook_size) float32 scores)."""
    num_requests = log_probs.shape[0]
    return constrained_beam_step(
        BeamState.root(num_requests, log_probs.device), log_probs[:, None, :],
        spec.trie.levels[0], None, beam_width, max(top_k, beam_width), allowed,
    )  # fmt: skip


def _level_one_after_every_code(
    spec: DecodeSpec,
    first: torch.Tensor,
    second: torch.Tensor,
    beam_width: int,
    top_k: int,
    allowed: torch.Tensor | None = None,
) -> BeamState:
    """Level 1's selection when level 0 kept every first-level code: level 0's beams are
    the V0 codes in ``first_codes`` order with their scores, and level 1's candidates are
    read from the rows that ran all of them. A first-level code the request's rules leave
    out has only children it may not take (``allowed``, level 1's).

    The results are those of the steps one after the other, with two differences that
    change no outcome: a code whose level-0 score is NaN is dropped here instead of at
    level 0, and candidates of exactly equal scores may come out in another order (the
    pool lists the codes in ``first_codes`` order, not by level-0 score).

    Args:
        first: (R, codebook_size) float32 level-0 code log-probabilities.
        second: (R * V0, codebook_size) float32 level-1 code log-probabilities of each
            request's code rows, request-major.
    """
    codes = spec.first_codes
    num_requests, num_codes = first.shape[0], codes.shape[0]
    shape = (num_requests, num_codes)
    zeros = torch.zeros(shape, dtype=torch.int64, device=first.device)
    level_0 = BeamState(first[:, codes], spec.first_nodes.expand(shape), codes.expand(shape), zeros)
    return constrained_beam_step(
        level_0, second.view(num_requests, num_codes, -1), spec.trie.levels[1], None,
        beam_width, top_k, allowed,
    )  # fmt: skip


def live_beam_widths(trie: PrefixTrie, beam_width: int, top_k: int) -> list[int]:
    """Beams per request that can hold a valid prefix when each later level's forward runs.

    A level's selection keeps at most ``beam_width`` beams, at most ``top_k`` per parent
    (all of a node's children where ``top_k`` is wider), and never more than the catalog's
    distinct prefixes of that length; the beams beyond are dead (score -inf) and sorted last
    (``constrained_beam_step``). The forward of level ``l`` therefore runs on the first
    ``widths[l - 1]`` beams of each request only: with 256 first-level codes and a beam of
    512, level 1's forward (and its LM head) runs on half the rows. The bound depends on
    the catalog and the search parameters alone, so the shapes stay fixed (CUDA graphs).

    Args:
        trie: the catalog's trie.
        beam_width, top_k: search parameters.

    Returns:
        widths[l - 1] for levels l = 1 .. num_levels - 1, each in [1, beam_width].
    """
    levels = trie.levels
    # The root is the first step's only parent and offers all of its children.
    live = min(beam_width, levels[0].num_children)
    widths = []
    for level in levels[1:]:
        widths.append(max(live, 1))
        live = min(beam_width, level.num_children, live * min(top_k, level.width))
    return widths
