"""What the scheduler queues and answers: a queued request, its answer (and the answering
of a finished batch), the errors that refuse it (with their HTTP statuses), and the
run-time model that decides whether its deadline can be met."""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import numpy as np

from xgr.core import InputTooLargeError, ModelOutputError, Prompt, RecommendResult, XgrError
from xgr.scheduler.metrics import RequestTimes, ServingMetrics


class DeadlineExceededError(XgrError):
    """The request's deadline passed, or cannot be met, before its batch starts (504)."""


class QueueFullError(XgrError):
    """The queue holds ``max_queue`` requests (429); ``retry_after`` in seconds (>= 1)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(XgrError):
    """The scheduler is draining or stopped and admits no new request (503)."""


class SchedulerFailedError(ShuttingDownError):
    """The scheduling loop itself failed: nothing more is served (503); the message names
    the failure."""


def http_status(exc: XgrError) -> int:
    """The HTTP status a serving error is answered with (the server's and the in-process
    load generator's one table): 500 model failure, 413 prompt too long, 429 queue full,
    503 shutting down, 504 deadline; any other ``XgrError`` is bad input (400)."""
    table = (
        (ModelOutputError, 500),  # the model's numbers, not the request, are at fault
        (InputTooLargeError, 413),  # a prompt or its embeddings over a limit
        (QueueFullError, 429),
        (ShuttingDownError, 503),
        (DeadlineExceededError, 504),
    )
    return next((status for cls, status in table if isinstance(exc, cls)), 400)


def check_max_batch_ms(value: float | None) -> None:
    """Raise XgrError unless value is None or a positive, finite number (ms)."""
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf
    ):
        raise XgrError(f"max_batch_ms must be a positive number of ms, got {value!r}")


@dataclass
class LatencyModel:
    """Predicted batch run time from measured seconds per scheduled token.

    Attributes:
        window: recent batches kept; the prediction uses the fastest of them, so a single
            slow batch cannot make deadlines look impossible (and, refused, never run again
            to correct it).
        rates: seconds per scheduled token of the recent batches, newest last.
    """

    window: int = 16
    rates: list[float] = field(default_factory=list)

    def observe(self, tokens: int, seconds: float) -> None:
        self.rates.append(seconds / max(tokens, 1))
        del self.rates[: -self.window]

    @property
    def seconds_per_token(self) -> float | None:
        return min(self.rates) if self.rates else None

    def predict(self, tokens: int) -> float:
        """Seconds for a batch of ``tokens`` scheduled tokens; 0 before any measurement."""
        rate = self.seconds_per_token
        return 0.0 if rate is None else rate * tokens


@dataclass(eq=False)
class QueuedRequest:
    """One request waiting for a batch; compared and hashed by identity (its prompt may be a
    NumPy array, whose field-by-field equality has no truth value).

    Attributes:
        prompt: token ids, already validated by the engine: a list, or the (tokens,) int64
            array of ``Engine.token_ids``, which the engine checks again in microseconds; or
            an ``xgr.Prompt`` with given input embeddings.
        beam_width, top_k, num_results: search parameters, already validated.
        exclude: item ids never returned.
        allow: the only item ids that may be returned; None: every item.
        item_filter: conditions on the catalog's item attributes (already checked by
            ``xgr.catalog.attributes.compile_filter``); None: no filter.
        deadline: ``time.perf_counter()`` after which it is not started; None for no deadline.
        recorded: counted in the metrics (False for the server's own warm-up request).
        future, deadline_timer: set when queued (the answer; the timer that answers 504 at
            the deadline if the request is still waiting, cancelled with the answer).
        order: set when queued: its place in the queue, (round, arrival number); see
            ``batch_policy.queue_orders``.
        catalog: the name of the catalog it searches (None: the engine's default).
    """

    prompt: list[int] | np.ndarray | Prompt
    beam_width: int
    top_k: int
    num_results: int
    exclude: frozenset[str] = frozenset()
    deadline: float | None = None
    arrived: float = field(default_factory=time.perf_counter)
    recorded: bool = True
    future: asyncio.Future | None = None
    deadline_timer: asyncio.TimerHandle | None = None
    order: tuple[int, int] = (0, 0)
    allow: frozenset[str] | None = None
    item_filter: dict | None = None
    catalog: str | None = None

    @property
    def batch_key(self) -> tuple:
        """What the requests of one batch share: one search and one catalog."""
        return (self.beam_width, self.top_k, self.catalog)


@dataclass(frozen=True)
class Answer:
    """What a request gets back: the result and its phase times in seconds."""

    result: RecommendResult
    times: RequestTimes


# Reported for every answered request: all semantic IDs have a fixed number of levels.
FINISHED_REASON = "length"


def answer_requests(
    live: list[QueuedRequest],
    results: list[RecommendResult],
    started: float,
    finished: float,
    metrics: ServingMetrics | None,
) -> None:
    """Answer each request of a finished batch with its result and times (and record them
    in ``metrics``); a request withdrawn meanwhile is skipped.

    Args:
        live: the batch's requests, in the engine call's order.
        results: the engine's results, one per request.
        started, finished: perf_counter seconds of the call's launch and of its results.
        metrics: the serving metrics, or None.
    """
    for request, result in zip(live, results, strict=True):
        device = (result.prefill_ms + result.decode_ms) / 1e3
        times = RequestTimes(
            # Until its batch's device work began (a launched batch may first wait for the
            # one ahead of it on the stream).
            queue=max(started - request.arrived, finished - request.arrived - device),
            prefill=result.prefill_ms / 1e3,
            decode=result.decode_ms / 1e3,
            e2e=finished - request.arrived,
        )
        if request.future.done():  # withdrawn while its batch ran: nobody to answer
            continue
        if metrics and request.recorded:
            metrics.observe_request(times, result.prompt_tokens, FINISHED_REASON, result.catalog)
        request.future.set_result(Answer(result, times))
