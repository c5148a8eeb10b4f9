"""The request scheduler: fixed-step batches formed by token budget, size and deadlines.

Requests wait in arrival order, except that the prompts of one completion larger than a batch
take one batch's share per round (``batch_policy.queue_orders``), so requests arriving meanwhile
are not held for all of it. When the engine is free, the next batch takes the first request
and, in queue order, the waiting requests with the same beam width and top-k, while

- the batch has at most ``max_batch_size`` requests,
- its scheduled tokens (prompt tokens + beam width x levels per request) fit
  ``max_batch_tokens``, and
- the batch's predicted run time still lets its earliest deadline be met, and stays within
  ``max_batch_ms`` when set: the batch shrinks (newest requests return to the queue) until
  it does, down to one request. Requests that arrive while a batch runs wait for all of it,
  so under a P99 budget a batch should take a fraction of the budget; where prefill is
  compute-bound (long prompts) a larger batch costs its requests' sum and gains nothing.

A deadline is the time by which the answer is wanted. A batch runs all its decode steps
together (fixed-step: no re-batching between steps). Run times are predicted from recent
batches' seconds per scheduled token, taking the fastest of the last ``LatencyModel.window``
batches, so one slow batch (a first capture, a pause) does not make every later deadline look
impossible. Work is refused before it is spent: at admission when the batches running, the
requests already waiting and its own run would take past the deadline (unless nothing is
running or waiting), and in the queue once the deadline has passed. The queue is
bounded (``QueueFullError``, answered 429 with Retry-After); a request whose client went away
is dropped before its batch starts; ``stop(drain=True)`` finishes every admitted request
before the loop ends. A failing engine call fails its own requests, never the loop; should the
loop itself fail, ``failure`` says why, every waiting request is answered with
``SchedulerFailedError`` and no new one is admitted.

Requests and batches are tracked by identity (a request's prompt may be a NumPy array, for which
equality has no truth value), and a finished batch releases its engine lane before anything
else is done.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from xgr.core import RecommendationEngine, XgrError, positive_int
from xgr.scheduler.batch_policy import form_batch, refuse_late
from xgr.scheduler.metrics import ServingMetrics
from xgr.scheduler.requests import (
    Answer,
    DeadlineExceededError,
    LatencyModel,
    QueuedRequest,
    QueueFullError,
    SchedulerFailedError,
    ShuttingDownError,
    answer_requests,
    check_max_batch_ms,
)
from xgr.scheduler.timeline import DeviceTimeline
from xgr.scheduler.waiting import WaitingQueue

logger = logging.getLogger(__name__)


class RequestBatcher:
    """Schedules concurrent requests into ``engine.recommend_async`` calls, each launched and
    collected in worker threads.

    Args:
        engine: an ``xgr.Engine`` (any ``RecommendationEngine``).
        max_batch_size: most requests per engine call.
        metrics: where queue, batch and latency figures go (optional).
        max_batch_tokens: most scheduled tokens (prompt + beam width x levels) per call; a
            single larger request still runs, alone.
        max_queue: most requests waiting; more are refused with ``QueueFullError``.
        max_inflight: engine calls running at once (batches in flight, e.g. one per CUDA
            stream of an engine built with ``cuda_streams``); 1 runs batches one by one.
        max_batch_ms: longest predicted run time of a batch of several requests (ms), from
            the measured seconds per token; None: no limit.

    Raises:
        XgrError: a limit below 1 (max_batch_ms: not a positive number).
    """

    def __init__(
        self,
        engine: RecommendationEngine,
        max_batch_size: int = 32,
        metrics: ServingMetrics | None = None,
        max_batch_tokens: int = 1 << 20,
        max_queue: int = 4096,
        max_inflight: int = 1,
        max_batch_ms: float | None = None,
    ) -> None:
        for name, value in (
            ("max_batch_size", max_batch_size),
            ("max_batch_tokens", max_batch_tokens),
            ("max_queue", max_queue),
            ("max_inflight", max_inflight),
        ):
            positive_int(name, value)
        check_max_batch_ms(max_batch_ms)
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.max_batch_ms = max_batch_ms
        self.max_batch_tokens = max_batch_tokens
        self.max_queue = max_queue
        self.max_inflight = max_inflight
        self.metrics = metrics
        self.levels = engine.num_levels
        self.latency = LatencyModel()
        self._waiting = WaitingQueue(self.cost, max_batch_size, max_batch_tokens)
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._batches: dict[int, list[QueuedRequest]] = {}  # id(batch) -> a running batch
        self._runs: set[asyncio.Task] = set()
        self._slots: asyncio.Semaphore | None = None
        self._closing = False
        self.failure: str | None = None  # why the scheduling loop stopped, if it failed
        # Pipelining (max_inflight > 1): the batches in flight on the device, and an event
        # set whenever one finishes.
        self._timeline = DeviceTimeline()
        self._progress: asyncio.Event | None = None

    def cost(self, request: QueuedRequest) -> int:
        """Scheduled tokens of a request: its prompt plus one token per beam and level."""
        return len(request.prompt) + request.beam_width * self.levels

    @property
    def healthy(self) -> bool:
        """True while the scheduling loop runs (started and not failed)."""
        return self._task is not None and not self._task.done() and self.failure is None

    @property
    def waiting(self) -> int:
        """Requests waiting for a batch."""
        return len(self._waiting)

    def start(self) -> None:
        """Start the scheduling loop on the running event loop."""
        if self._task is None:
            self._wakeup = asyncio.Event()
            self._progress = asyncio.Event()
            self._slots = asyncio.Semaphore(self.max_inflight)
            self._closing = False
            self.failure = None
            self._task = asyncio.get_running_loop().create_task(self._loop())
            self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """The loop's done callback: a loop that failed is logged, said by ``failure`` and
        ``healthy``, and answers every waiting request, instead of leaving them to hang."""
        if task.cancelled() or task.exception() is None:
            return
        exc = task.exception()
        self.failure = f"the scheduler failed: {type(exc).__name__}: {exc}"
        logger.error("%s", self.failure, exc_info=exc)
        for request in self._waiting.take_all():
            if not request.future.done():
                request.future.set_exception(SchedulerFailedError(self.failure))
        self._report_load()

    async def stop(self, drain: bool = False, timeout: float = 60.0) -> None:
        """Stop admitting requests and end the loop.

        Args:
            drain: first finish every admitted request (waiting or running), for at most
                ``timeout`` seconds; otherwise they fail at once.
            timeout: seconds to wait for the drain.

        Requests still unanswered at the end fail with ``ShuttingDownError``, never hang.
        """
        self._closing = True
        if drain and self._task is not None:  # a loop that failed has nothing more to drain
            end = time.perf_counter() + timeout
            while (self._waiting or self._batches) and not self._task.done():
                if time.perf_counter() >= end:
                    break
                await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except BaseException:  # cancelled, or died earlier: either way it is over
                pass
            self._task = None
        runs = list(self._runs)
        for run in runs:
            run.cancel()
        unanswered = [r for batch in self._batches.values() for r in batch]
        unanswered += self._waiting.take_all()
        await asyncio.gather(*runs, return_exceptions=True)  # they fail their own batches
        for request in unanswered:
            if not request.future.done():
                request.future.set_exception(ShuttingDownError("the server is shutting down"))
        self._batches, self._runs = {}, set()
        self._report_load()

    async def submit(self, request: QueuedRequest) -> Answer:
        """Queue a request and wait for its answer.

        Cancelling the awaiting task (a client that went away) withdraws the request if its
        batch has not started.

        Raises:
            DeadlineExceededError: the requests waiting ahead would take past its deadline,
                or the deadline passed while it waited.
            QueueFullError: ``max_queue`` requests are already waiting.
            ShuttingDownError: the scheduler is stopping or not running.
            XgrError: the engine refused it.
        """
        (future,) = self._admit([request])
        return await self._answer(request, future)

    async def submit_all(self, requests: list[QueuedRequest]) -> list[Answer]:
        """Queue several requests together (all admitted or none) and wait for every answer.

        Raises:
            XgrError: more requests than the queue can ever hold (a client error, not 429).
            the errors of ``submit``: the first failing request's; the group's other
                requests are then withdrawn.
        """
        if len(requests) > self.max_queue:
            raise XgrError(f"{len(requests)} requests exceed the queue's {self.max_queue} places")
        futures = self._admit(requests)
        answers = [
            asyncio.ensure_future(self._answer(r, f))
            for r, f in zip(requests, futures, strict=True)
        ]
        try:
            return list(await asyncio.gather(*answers))
        except BaseException:
            # The group is answered whole or not at all: the rest would be wasted work (those
            # still waiting leave the queue), and each outcome is collected, so none is
            # logged as an exception never retrieved.
            for answer in answers:
                answer.cancel()
            await asyncio.gather(*answers, return_exceptions=True)
            raise

    def check_admission(
        self, count: int = 1, deadline: float | None = None, tokens: int = 0
    ) -> None:
        """Raise what admitting ``count`` requests with this ``deadline`` would raise now;
        costs microseconds, so a server can refuse before it reads a request's body.

        Args:
            count: requests to be admitted together.
            deadline: their ``time.perf_counter()`` deadline, or None.
            tokens: their own scheduled tokens, when known (0: not yet known).

        Raises:
            SchedulerFailedError, ShuttingDownError: the loop failed, or is stopping or not
                running.
            QueueFullError: the queue has no room for them.
            DeadlineExceededError: the deadline passed, or the batches running, the requests
                waiting ahead and their own run would take past it (predicted).
        """
        if self.failure is not None:
            raise SchedulerFailedError(self.failure)
        if self._task is None or self._task.done() or self._closing:
            raise ShuttingDownError("the scheduler is not running")
        if len(self._waiting) + count > self.max_queue:
            retry = max(1, math.ceil(self.latency.predict(self._waiting.tokens)))
            waiting = len(self._waiting)
            raise QueueFullError(
                f"the queue is full ({waiting} requests are waiting); retry in {retry} s", retry
            )
        if deadline is None:
            return
        now = time.perf_counter()
        if now > deadline:
            raise DeadlineExceededError("the deadline passed before the request was queued")
        # Admitted work that would answer after the deadline is work for nobody. A request
        # that finds nothing running or waiting always runs: refused on the prediction
        # alone, a slow first measurement would never be corrected.
        start = self._timeline.start_of_next(now, bool(self._batches))
        done = start + self.latency.predict(self._waiting.tokens + tokens)
        if done > deadline and (self._batches or self._waiting):
            late_ms = (done - deadline) * 1e3
            raise DeadlineExceededError(
                f"the deadline cannot be met: the batches running, the requests waiting ahead "
                f"and its own run need {late_ms:.0f} ms more than it leaves"
            )

    def _admit(self, requests: list[QueuedRequest]) -> list[asyncio.Future]:
        deadlines = [r.deadline for r in requests if r.deadline is not None]
        costs = [self.cost(r) for r in requests]
        self.check_admission(len(requests), min(deadlines) if deadlines else None, sum(costs))
        now = time.perf_counter()
        loop = asyncio.get_running_loop()
        self._waiting.add(requests, costs)
        for request in requests:
            request.future = loop.create_future()
            if request.deadline is not None:
                # Answered 504 when the deadline passes in the queue, not when the next batch
                # is formed (which can be a whole batch's run time later).
                request.deadline_timer = loop.call_later(
                    request.deadline - now, self._expire, request
                )
        self._wakeup.set()
        self._report_load()
        return [r.future for r in requests]

    def _expire(self, request: QueuedRequest) -> None:
        """The deadline timer of a request: a 504 if it is still waiting for its batch."""
        if request.future.done() or not self._waiting.withdraw(request):
            return  # answered, withdrawn, or in a batch that has started
        refuse_late(request, time.perf_counter())
        self._report_load()

    async def _answer(self, request: QueuedRequest, future: asyncio.Future) -> Answer:
        try:
            return await future
        except asyncio.CancelledError:
            future.cancel()
            if self._waiting.withdraw(request):
                self._report_load()
            raise
        finally:
            # Answered, refused or withdrawn: the timer would otherwise hold the request and
            # its answer until the deadline (up to an hour away).
            if request.deadline_timer is not None:
                request.deadline_timer.cancel()
                request.deadline_timer = None

    def _next_batch(self) -> list[QueuedRequest]:
        """Take the next batch from the queue (see the module docstring); may be empty."""
        now = time.perf_counter()
        kept = self._waiting.in_order(now)
        if not kept:
            return []
        # A batch launched behind others starts on the device when they are predicted done.
        start = self._timeline.start_of_next(now, bool(self._batches))
        batch, tokens = form_batch(
            kept, self.cost, start, self.latency, self.max_batch_size, self.max_batch_tokens,
            self.max_batch_ms,
        )  # fmt: skip
        self._timeline.launched(id(batch), start + self.latency.predict(tokens))
        self._waiting.take(batch)
        return batch

    async def _loop(self) -> None:
        while True:
            if not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            await self._slots.acquire()  # a free engine lane (one, unless max_inflight > 1)
            await self._pace()
            batch = self._next_batch()
            if not batch:
                self._slots.release()
                continue
            self._batches[id(batch)] = batch
            run = asyncio.get_running_loop().create_task(self._run_safely(batch, self._slots))
            self._runs.add(run)
            run.add_done_callback(self._runs.discard)
            if self.max_inflight == 1:
                await asyncio.wait({run})  # one batch at a time: form the next when it ends

    async def _pace(self) -> None:
        """With batches in flight, wait until the device is predicted to be free in about
        the time a launch takes, so that the next batch, launched then, queues right behind
        them: formed at once it would hold only the few requests waiting now, and the ones
        arriving meanwhile would wait for a later batch. Several CUDA streams running
        batches side by side finish sooner than this sequential prediction; it then only
        delays forming."""
        while self._batches:
            wait = self._timeline.free_at - self._timeline.lead() - time.perf_counter()
            if wait <= 0:
                return
            self._progress.clear()
            try:
                await asyncio.wait_for(self._progress.wait(), wait)
            except TimeoutError:
                return

    async def _run_safely(self, batch: list[QueuedRequest], slots: asyncio.Semaphore) -> None:
        """Run one batch; whatever goes wrong fails its own requests, never the loop.

        ``slots`` is the semaphore this run holds (a restarted scheduler has a new one). The
        lane is released first, whatever happens after, so a fault in the bookkeeping cannot
        leave the scheduler one lane short for good.
        """
        try:
            await self._run(batch)
        except Exception as exc:
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(
                        XgrError(f"the engine call failed: {type(exc).__name__}: {exc}")
                    )
        finally:
            slots.release()
            self._batches.pop(id(batch), None)
            for request in batch:  # cancelled (stop) or otherwise cut short: never left hanging
                if not request.future.done():
                    request.future.set_exception(ShuttingDownError("the server is shutting down"))
            self._timeline.finished(id(batch), time.perf_counter(), bool(self._batches))
            if self._progress is not None:
                self._progress.set()
            self._report_load()

    async def _run(self, group: list[QueuedRequest]) -> None:
        live = [r for r in group if not r.future.done()]  # the client may have gone
        if not live:
            return
        started = time.perf_counter()
        self._report_load()
        args = ([r.prompt for r in live],)
        kwargs = dict(
            beam_width=group[0].beam_width,
            top_k=group[0].top_k,
            catalog=group[0].catalog,
            num_results=[r.num_results for r in live],
            exclude_item_ids=[r.exclude for r in live],
            allow_item_ids=[r.allow for r in live],
            item_filter=[r.item_filter for r in live],
        )
        try:
            # Launched, the batch runs while the loop forms and launches the next.
            pending = await asyncio.to_thread(self.engine.recommend_async, *args, **kwargs)
            if any(r.recorded for r in live):  # not the warm-up request's compile
                self._timeline.record_launch(time.perf_counter() - started)
            results = await asyncio.to_thread(pending.result)
        except asyncio.CancelledError:
            if self._closing:  # stop(): the loop itself is being cancelled
                raise
            # The engine raised CancelledError itself: a failure of this batch only.
            for request in live:
                if not request.future.done():
                    request.future.set_exception(XgrError("the engine call was cancelled"))
            return
        except Exception as exc:  # one failed call must not lose the others' answers
            for request in live:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        finished = time.perf_counter()
        if not isinstance(results, list) or len(results) != len(live):
            raise XgrError(f"expected {len(live)} results, got {type(results).__name__}")
        recorded = [r for r in live if r.recorded]
        if self.metrics and recorded and results:  # the server's warm-up batch is not traffic
            self.metrics.observe_batch(len(recorded), results[0].catalog)
        device = (results[0].prefill_ms + results[0].decode_ms) / 1e3 if results else None
        ran = self._timeline.run_seconds(started, finished, device)
        if any(r.recorded for r in live):  # the warm-up request's compile time is no measure
            self.latency.observe(sum(self.cost(r) for r in live), ran)
        answer_requests(live, results, started, finished, self.metrics)

    def _report_load(self) -> None:
        if self.metrics:
            running = sum(len(b) for b in self._batches.values())
            self.metrics.set_load(running, len(self._waiting))
