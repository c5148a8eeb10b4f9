"""Which waiting requests form the next batch (``RequestBatcher``'s policy, as functions)."""

from __future__ import annotations

from collections.abc import Callable

from xgr.scheduler.requests import DeadlineExceededError, LatencyModel, QueuedRequest


def live_requests(waiting: list[QueuedRequest], now: float) -> list[QueuedRequest]:
    """The waiting requests still to serve, in order: withdrawn ones dropped, and those whose
    deadline passed at ``now`` (perf_counter s) answered with ``DeadlineExceededError``."""
    kept = []
    for request in waiting:
        if request.future.done():  # withdrawn
            continue
        if request.deadline is not None and now > request.deadline:
            refuse_late(request, now)
            continue
        kept.append(request)
    return kept


def refuse_late(request: QueuedRequest, now: float) -> None:
    """Answer a queued request whose deadline passed at ``now`` (perf_counter s) with a 504."""
    waited_ms = (now - request.arrived) * 1e3
    request.future.set_exception(
        DeadlineExceededError(f"deadline passed after {waited_ms:.0f} ms in the queue")
    )


def form_batch(
    queue: list[QueuedRequest],
    cost: Callable[[QueuedRequest], int],
    start: float,
    latency: LatencyModel,
    max_batch_size: int,
    max_batch_tokens: int,
    max_batch_ms: float | None,
) -> tuple[list[QueuedRequest], int]:
    """The next batch of a non-empty queue (``xgr.scheduler.batcher``'s module docstring).

    The oldest request and, in order, the later ones with its beam width and top-k, within
    ``max_batch_size`` requests and ``max_batch_tokens`` scheduled tokens (a younger request
    never jumps one that does not fit); then the newest leave it while its predicted run,
    starting at ``start`` (perf_counter s), would miss its earliest deadline or exceed
    ``max_batch_ms``, down to one request.

    Returns:
        the batch, oldest first, and its scheduled tokens (``cost`` summed).
    """
    key = (queue[0].beam_width, queue[0].top_k)
    batch, tokens = [], 0
    for request in queue:
        if len(batch) == max_batch_size:
            break
        if (request.beam_width, request.top_k) != key:
            continue
        if batch and tokens + cost(request) > max_batch_tokens:
            break  # first in, first served: no younger request jumps ahead
        batch.append(request)
        tokens += cost(request)
    while len(batch) > 1:
        seconds = latency.predict(tokens)
        deadlines = [r.deadline for r in batch if r.deadline is not None]
        meets = not deadlines or start + seconds <= min(deadlines)
        if meets and (max_batch_ms is None or seconds * 1e3 <= max_batch_ms):
            break
        tokens -= cost(batch.pop())  # the newest waits for the next batch
    return batch, tokens
