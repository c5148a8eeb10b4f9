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


def queue_orders(
    costs: list[int],
    round_now: int,
    first_number: int,
    max_batch_size: int,
    max_batch_tokens: int,
) -> list[tuple[int, int]]:
    """The queue places of requests admitted together, as (round, arrival number).

    Batches are formed from the queue sorted by these places. A lone request joins the
    current round (``round_now``, the number of batches formed so far). A group (the prompts
    of one completion) takes one batch's share per round - at most ``max_batch_size``
    requests and ``max_batch_tokens`` scheduled tokens - so the later parts of a group larger
    than a batch wait behind requests that arrive meanwhile, one batch each round, instead of
    holding them for the whole group (start-time fair queueing with one batch as the
    quantum; Goyal, Vin and Cheng, SIGCOMM 1996).

    Args:
        costs: each request's scheduled tokens, in the group's order.
        round_now: batches formed so far.
        first_number: the arrival number of the first request (later ones count up).
        max_batch_size, max_batch_tokens: the batch limits.
    """
    orders, tokens = [], 0
    for i, cost in enumerate(costs):
        share = max(i // max_batch_size, tokens // max_batch_tokens)
        orders.append((round_now + share, first_number + i))
        tokens += cost
    return orders


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

    The first request and, in queue order, the later ones with its beam width, top-k and
    catalog (``QueuedRequest.batch_key``), within
    ``max_batch_size`` requests and ``max_batch_tokens`` scheduled tokens (a later request
    never jumps one that does not fit); then the newest leave it while its predicted run,
    starting at ``start`` (perf_counter s), would miss its earliest deadline or exceed
    ``max_batch_ms``, down to one request.

    Returns:
        the batch, oldest first, and its scheduled tokens (``cost`` summed).
    """
    key = queue[0].batch_key
    batch, tokens = [], 0
    for request in queue:
        if len(batch) == max_batch_size:
            break
        if request.batch_key != key:
            continue
        if batch and tokens + cost(request) > max_batch_tokens:
            break  # first in, first served: no later request jumps ahead
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
