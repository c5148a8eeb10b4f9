"""A simple request queue that runs concurrent requests as one engine call.

Requests that arrive while the engine is busy wait in the queue; when it is free, every
waiting request (up to ``max_batch_size``) forms the next batch. Requests of one batch with
different beam widths or top-k run as separate engine calls, one after the other.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from xgr.core import RecommendResult, XgrError
from xgr.scheduler.metrics import RequestTimes, ServingMetrics

# Reported for every answered request: all semantic IDs have a fixed number of levels.
FINISHED_REASON = "length"


class DeadlineExceededError(XgrError):
    """The request's deadline passed before its batch could start (the server answers 504)."""


@dataclass
class QueuedRequest:
    """One request waiting for a batch.

    Attributes:
        prompt: token ids, already validated by the engine.
        beam_width, top_k, num_results: search parameters, already validated.
        exclude: item ids left out of the result.
        deadline: ``time.perf_counter()`` after which it is not started; None for no deadline.
        recorded: counted in the metrics (False for the server's own warm-up request).
    """

    prompt: list[int]
    beam_width: int
    top_k: int
    num_results: int
    exclude: frozenset[str] = frozenset()
    deadline: float | None = None
    arrived: float = field(default_factory=time.perf_counter)
    recorded: bool = True
    future: asyncio.Future | None = None


@dataclass(frozen=True)
class Answer:
    """What a request gets back: the result and its phase times in seconds."""

    result: RecommendResult
    times: RequestTimes


class RequestBatcher:
    """Batches concurrent requests into ``engine.recommend`` calls, run in a worker thread.

    Args:
        engine: an ``xgr.Engine``.
        max_batch_size: most requests per engine call.
        metrics: where queue, batch and latency figures go (optional).
    """

    def __init__(
        self, engine: Any, max_batch_size: int = 32, metrics: ServingMetrics | None = None
    ) -> None:
        if max_batch_size < 1:
            raise XgrError(f"max_batch_size must be >= 1, got {max_batch_size}")
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.metrics = metrics
        self._queue: asyncio.Queue[QueuedRequest] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self._running = 0
        self._batch: list[QueuedRequest] = []  # taken from the queue, not all answered yet

    def start(self) -> None:
        """Start the batching loop on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop the loop; requests not yet answered fail with an error rather than hang."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        unanswered = list(self._batch)
        while not self._queue.empty():
            unanswered.append(self._queue.get_nowait())
        for request in unanswered:
            if not request.future.done():
                request.future.set_exception(XgrError("the server is shutting down"))
        self._batch = []

    async def submit(self, request: QueuedRequest) -> Answer:
        """Queue a request and wait for its answer.

        Raises:
            DeadlineExceededError: its deadline passed before its batch started.
            XgrError: the engine refused it.
        """
        if self._task is None:
            raise XgrError("the batcher is not running")
        request.future = asyncio.get_running_loop().create_future()
        await self._queue.put(request)
        self._report_load()
        return await request.future

    async def _loop(self) -> None:
        while True:
            self._batch = batch = [await self._queue.get()]
            while len(batch) < self.max_batch_size and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            groups: dict[tuple[int, int], list[QueuedRequest]] = defaultdict(list)
            for request in batch:
                groups[(request.beam_width, request.top_k)].append(request)
            for (beam_width, top_k), group in groups.items():
                await self._run(group, beam_width, top_k)
            self._batch = []

    async def _run(self, group: list[QueuedRequest], beam_width: int, top_k: int) -> None:
        started = time.perf_counter()
        live = []
        for request in group:
            if request.future.done():  # the client went away
                continue
            if request.deadline is not None and started > request.deadline:
                waited_ms = (started - request.arrived) * 1e3
                request.future.set_exception(
                    DeadlineExceededError(f"deadline passed after {waited_ms:.0f} ms in the queue")
                )
                continue
            live.append(request)
        if not live:
            return
        self._running = len(live)
        self._report_load()
        if self.metrics:
            self.metrics.observe_batch(len(live))
        try:
            results = await asyncio.to_thread(
                self.engine.recommend,
                [r.prompt for r in live],
                beam_width=beam_width,
                top_k=top_k,
                num_results=[r.num_results for r in live],
                exclude_item_ids=[r.exclude for r in live],
            )
        except Exception as exc:  # one failed call must not lose the others' answers
            for request in live:
                if not request.future.done():
                    request.future.set_exception(exc)
            return
        finally:
            self._running = 0
            self._report_load()
        finished = time.perf_counter()
        for request, result in zip(live, results, strict=True):
            times = RequestTimes(
                queue=started - request.arrived,
                prefill=result.prefill_ms / 1e3,
                decode=result.decode_ms / 1e3,
                e2e=finished - request.arrived,
            )
            if self.metrics and request.recorded:
                self.metrics.observe_request(times, result.prompt_tokens, FINISHED_REASON)
            if not request.future.done():
                request.future.set_result(Answer(result, times))

    def _report_load(self) -> None:
        if self.metrics:
            self.metrics.set_load(self._running, self._queue.qsize())
