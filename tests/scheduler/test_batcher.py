"""The batching queue: grouping, deadlines, failures and shutdown, with a recording engine."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from xgr.core import RecommendResult, XgrError
from xgr.scheduler import (
    DeadlineExceededError,
    QueuedRequest,
    QueueFullError,
    RequestBatcher,
    SchedulerFailedError,
    ServingMetrics,
    ShuttingDownError,
)


class Deferred:
    """A launch whose work runs when its result is asked for (an engine stand-in's)."""

    def __init__(self, work) -> None:
        self._work = work

    def result(self):
        return self._work()


class RecordingEngine:
    """Stands in for ``Engine``: records each call, answers with the prompt's length."""

    max_in_flight = 1
    num_levels = 1

    def recommend_async(self, prompts, beam_width, top_k, num_results, exclude_item_ids, **rules):
        search = dict(beam_width=beam_width, top_k=top_k, num_results=num_results,
                      exclude_item_ids=exclude_item_ids)  # fmt: skip
        return Deferred(lambda: self.recommend(prompts, **search))

    def __init__(self, delay: float = 0.0, fail_on: int | None = None) -> None:
        self.calls: list[tuple[list[list[int]], int, int, list[int]]] = []
        self.delay = delay
        self.fail_on = fail_on
        self.release = threading.Event()
        self.release.set()

    def recommend(self, prompts, beam_width, top_k, num_results, exclude_item_ids):
        self.release.wait(10)
        time.sleep(self.delay)
        self.calls.append((prompts, beam_width, top_k, list(num_results)))
        if self.fail_on is not None and any(p[0] == self.fail_on for p in prompts):
            raise XgrError("engine refused the batch")
        return [
            RecommendResult(prompt_tokens=len(p), prefill_ms=1.0, decode_ms=2.0) for p in prompts
        ]


def request(first_token: int, beam_width: int = 8, deadline: float | None = None):
    return QueuedRequest([first_token, 1, 2], beam_width, beam_width, 3, deadline=deadline)


async def run_concurrently(batcher, requests):
    return await asyncio.gather(*(batcher.submit(r) for r in requests), return_exceptions=True)


def test_requests_waiting_together_share_one_call_per_beam_width():
    engine = RecordingEngine()
    metrics = ServingMetrics("m")

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=16, metrics=metrics)
        batcher.start()
        engine.release.clear()  # hold the first call so the others queue up behind it
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.05)
        rest = [request(i, beam_width=8 if i % 2 else 16) for i in range(1, 11)]
        pending = asyncio.ensure_future(run_concurrently(batcher, rest))
        await asyncio.sleep(0.05)
        engine.release.set()
        answers = [await first, *(await pending)]
        await batcher.stop()
        return answers

    answers = asyncio.run(scenario())
    assert all(a.result.prompt_tokens == 3 for a in answers)
    assert [len(c[0]) for c in engine.calls] == [1, 5, 5]
    assert {c[1] for c in engine.calls[1:]} == {8, 16}
    assert sorted(p[0] for c in engine.calls for p in c[0]) == list(range(11))
    assert answers[0].times.prefill == pytest.approx(1e-3)
    assert answers[0].times.e2e >= answers[0].times.queue >= 0


def test_max_batch_size_splits_the_queue():
    engine = RecordingEngine()

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=3)
        batcher.start()
        engine.release.clear()
        pending = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(7)]))
        await asyncio.sleep(0.05)
        engine.release.set()
        await pending
        await batcher.stop()

    asyncio.run(scenario())
    # All seven are queued before the loop first wakes: 3, 3, then the last one.
    assert [len(c[0]) for c in engine.calls] == [3, 3, 1]


def test_expired_deadline_is_refused_before_running():
    engine = RecordingEngine()

    async def scenario():
        batcher = RequestBatcher(engine)
        batcher.start()
        answers = await run_concurrently(
            batcher, [request(0, deadline=time.perf_counter() - 1), request(1)]
        )
        await batcher.stop()
        return answers

    expired, ok = asyncio.run(scenario())
    assert isinstance(expired, DeadlineExceededError)
    assert "before the request was queued" in str(expired)
    assert ok.result.prompt_tokens == 3
    assert [p[0] for c in engine.calls for p in c[0]] == [1]


def test_a_failed_call_fails_only_its_requests_and_the_loop_goes_on():
    engine = RecordingEngine(fail_on=5)

    async def scenario():
        batcher = RequestBatcher(engine)
        batcher.start()
        failed = await run_concurrently(batcher, [request(5)])
        later = await batcher.submit(request(6))
        await batcher.stop()
        return failed[0], later

    failed, later = asyncio.run(scenario())
    assert isinstance(failed, XgrError) and "refused" in str(failed)
    assert later.result.prompt_tokens == 3


def test_stop_fails_queued_requests_instead_of_hanging():
    engine = RecordingEngine()

    async def scenario():
        batcher = RequestBatcher(engine)
        batcher.start()
        engine.release.clear()
        pending = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(3)]))
        await asyncio.sleep(0.05)
        stopping = asyncio.ensure_future(batcher.stop())
        await asyncio.sleep(0.05)
        engine.release.set()
        await stopping
        return await asyncio.wait_for(pending, 5)

    answers = asyncio.run(scenario())
    assert any(isinstance(a, XgrError) and "shutting down" in str(a) for a in answers)


def test_submit_needs_a_running_batcher():
    async def scenario():
        await RequestBatcher(RecordingEngine()).submit(request(0))

    with pytest.raises(XgrError, match="not running"):
        asyncio.run(scenario())
    with pytest.raises(XgrError, match="max_batch_size"):
        RequestBatcher(RecordingEngine(), max_batch_size=0)


def held_batcher(engine, **kwargs):
    """A started batcher whose engine holds its first call until ``engine.release`` is set."""
    batcher = RequestBatcher(engine, **kwargs)
    batcher.start()
    engine.release.clear()
    return batcher


def test_token_budget_limits_a_batch():
    engine = RecordingEngine()

    async def scenario():
        # Each request costs 3 prompt tokens + 8 beams x 1 level = 11 tokens.
        batcher = held_batcher(engine, max_batch_size=16, max_batch_tokens=30)
        pending = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(5)]))
        await asyncio.sleep(0.05)
        engine.release.set()
        await pending
        await batcher.stop()

    asyncio.run(scenario())
    assert [len(c[0]) for c in engine.calls] == [2, 2, 1]  # at most 30 tokens a call


def test_batch_shrinks_so_the_oldest_deadline_is_met():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine, max_batch_size=16)
        batcher.latency.rates = [0.01]  # 11 tokens a request: 0.11 s each
        batcher.latency.observe = lambda tokens, seconds: None  # keep the prediction fixed
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)
        deadline = time.perf_counter() + 0.4
        rest = [request(i, deadline=deadline if i == 1 else None) for i in range(1, 6)]
        pending = asyncio.ensure_future(run_concurrently(batcher, rest))
        await asyncio.sleep(0.02)
        engine.release.set()
        answers = [await first, *(await pending)]
        await batcher.stop()
        return answers

    answers = asyncio.run(scenario())
    assert all(not isinstance(a, Exception) for a in answers)
    # Request 1's deadline leaves room for 3 requests (0.33 s < 0.4 s), not 5.
    assert [len(c[0]) for c in engine.calls] == [1, 3, 2]


def test_max_batch_ms_caps_a_batch_by_its_predicted_run_time():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine, max_batch_size=16, max_batch_ms=250)
        batcher.latency.rates = [0.01]  # 11 tokens a request: 110 ms each
        batcher.latency.observe = lambda tokens, seconds: None
        pending = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(6)]))
        await asyncio.sleep(0.05)
        engine.release.set()
        answers = await pending
        await batcher.stop()
        return answers

    answers = asyncio.run(scenario())
    assert all(not isinstance(a, Exception) for a in answers)
    # 2 a call: 220 ms <= 250 ms < 330 ms (without the limit: one call of 6)
    assert [len(c[0]) for c in engine.calls] == [2, 2, 2]


@pytest.mark.parametrize("value", [0, -5, float("inf"), float("nan"), "50", True])
def test_max_batch_ms_must_be_a_positive_number(value):
    with pytest.raises(XgrError, match="max_batch_ms"):
        RequestBatcher(RecordingEngine(), max_batch_ms=value)


def test_a_deadline_that_cannot_be_met_is_refused_at_admission():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine)
        batcher.latency.rates = [0.01]
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held
        held = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(1, 5)]))
        await asyncio.sleep(0.02)  # 4 x 11 tokens waiting: 0.44 s ahead
        started = time.perf_counter()
        with pytest.raises(DeadlineExceededError, match="cannot be met"):
            await batcher.submit(request(9, deadline=time.perf_counter() + 0.05))
        refused_in = time.perf_counter() - started
        engine.release.set()
        await first, await held
        await batcher.stop()
        return refused_in

    assert asyncio.run(scenario()) < 0.05  # said at once, not after waiting
    assert 9 not in [p[0] for c in engine.calls for p in c[0]]


def test_a_deadline_passing_in_the_queue_is_answered_at_the_deadline():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine)
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held: the next request waits behind it
        started = time.perf_counter()
        with pytest.raises(DeadlineExceededError, match="deadline passed after"):
            await batcher.submit(request(9, deadline=time.perf_counter() + 0.05))
        refused_in = time.perf_counter() - started
        waiting = len(batcher._waiting)
        engine.release.set()
        await first
        await batcher.stop()
        return refused_in, waiting

    refused_in, waiting = asyncio.run(scenario())
    assert 0.04 < refused_in < 0.5  # at its deadline, while the batch ahead is still held
    assert waiting == 0
    assert 9 not in [p[0] for c in engine.calls for p in c[0]]


def test_deadline_timers_are_released_with_the_answer():
    engine = RecordingEngine()

    async def scenario():
        batcher = RequestBatcher(engine)
        batcher.start()
        far = [request(i, deadline=time.perf_counter() + 3600) for i in range(5)]
        await run_concurrently(batcher, far)
        await batcher.stop()
        return far

    # An hour-away timer would otherwise hold each request and its answer for that hour.
    assert all(r.deadline_timer is None and r.future.done() for r in asyncio.run(scenario()))


def test_full_queue_is_refused_with_a_retry_time():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine, max_queue=3)
        batcher.latency.rates = [0.2]
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held
        held = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(1, 4)]))
        await asyncio.sleep(0.02)  # three waiting
        with pytest.raises(
            QueueFullError, match=r"queue is full \(3 requests are waiting\); retry in 7 s"
        ) as refused:
            await batcher.submit(request(9))
        engine.release.set()
        answers = [await first, *(await held)]
        await batcher.stop()
        return refused.value.retry_after, answers

    retry_after, answers = asyncio.run(scenario())
    assert retry_after == 7  # 3 waiting x 11 tokens x 0.2 s, rounded up
    assert all(not isinstance(a, Exception) for a in answers)


def test_a_withdrawn_request_never_reaches_the_engine():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine)
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)
        gone = asyncio.ensure_future(batcher.submit(request(1)))
        stays = asyncio.ensure_future(batcher.submit(request(2)))
        await asyncio.sleep(0.02)
        gone.cancel()  # the client disconnected while waiting
        engine.release.set()
        await first, await stays
        await batcher.stop()

    asyncio.run(scenario())
    assert [p[0] for c in engine.calls for p in c[0]] == [0, 2]


def test_drain_finishes_every_admitted_request_and_then_refuses():
    engine = RecordingEngine(delay=0.01)

    async def scenario():
        batcher = held_batcher(engine, max_batch_size=4)
        pending = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(10)]))
        await asyncio.sleep(0.02)
        stopping = asyncio.ensure_future(batcher.stop(drain=True))
        await asyncio.sleep(0.02)
        with pytest.raises(ShuttingDownError):
            await batcher.submit(request(99))
        engine.release.set()
        await stopping
        return await pending

    answers = asyncio.run(scenario())
    assert [a.result.prompt_tokens for a in answers] == [3] * 10


def test_a_burst_of_500_is_answered_once_each():
    engine = RecordingEngine()

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=32)
        batcher.start()
        burst = [QueuedRequest([i] * (1 + i % 7), 8 if i % 3 else 16, 8, 3) for i in range(500)]
        answers = await run_concurrently(batcher, burst)
        await batcher.stop()
        return burst, answers

    burst, answers = asyncio.run(scenario())
    assert [a.result.prompt_tokens for a in answers] == [len(r.prompt) for r in burst]
    served = [p[0] for c in engine.calls for p in c[0]]
    assert sorted(served) == list(range(500))  # every request once, none twice
    assert all(len(c[0]) <= 32 for c in engine.calls)


def test_one_slow_batch_does_not_lock_out_deadline_requests():
    engine = RecordingEngine(delay=0.3)  # the first call is slow (a capture, a pause)

    async def scenario():
        batcher = RequestBatcher(engine)
        batcher.start()
        await batcher.submit(request(0))
        engine.delay = 0.0
        # An idle queue: nothing ahead, so a short deadline is accepted and met.
        answers = [await batcher.submit(request(i, deadline=time.perf_counter() + 0.1))
                   for i in range(1, 4)]  # fmt: skip
        await batcher.stop()
        return answers

    answers = asyncio.run(scenario())
    assert all(a.result.prompt_tokens == 3 for a in answers)


class BrokenEngine(RecordingEngine):
    """Answers with one result too few, or raises ``CancelledError`` itself."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def recommend(self, prompts, **kwargs):
        results = super().recommend(prompts, **kwargs)
        if prompts[0][0] == 66:
            if self.mode == "short":
                return results[:-1]
            raise asyncio.CancelledError()
        return results


@pytest.mark.parametrize("mode", ["short", "cancelled"])
def test_a_broken_engine_answer_fails_its_batch_and_the_loop_goes_on(mode):
    engine = BrokenEngine(mode)

    async def scenario():
        batcher = RequestBatcher(engine)
        batcher.start()
        broken = await run_concurrently(batcher, [request(66), request(67)])
        later = await asyncio.wait_for(batcher.submit(request(1)), 5)
        await batcher.stop()
        return broken, later

    broken, later = asyncio.run(scenario())
    assert all(isinstance(b, XgrError) for b in broken)
    assert later.result.prompt_tokens == 3


def test_submit_all_admits_together_or_not_at_all():
    engine = RecordingEngine()

    async def scenario():
        batcher = RequestBatcher(engine, max_queue=3)
        batcher.start()
        with pytest.raises(XgrError, match="exceed the queue"):
            await batcher.submit_all([request(i) for i in range(4)])
        answers = await batcher.submit_all([request(i) for i in range(3)])
        await batcher.stop()
        return answers

    assert [a.result.prompt_tokens for a in asyncio.run(scenario())] == [3, 3, 3]
    assert sorted(p[0] for c in engine.calls for p in c[0]) == [0, 1, 2]


def test_submit_all_withdraws_the_rest_of_a_group_once_one_request_fails():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine)
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held: the group waits behind it
        soon = time.perf_counter() + 0.05
        group = [request(7), request(8, deadline=soon), request(9)]
        with pytest.raises(DeadlineExceededError, match="deadline passed after"):
            await batcher.submit_all(group)
        waiting = len(batcher._waiting)
        engine.release.set()
        await first
        await batcher.stop()
        return group, waiting

    group, waiting = asyncio.run(scenario())
    assert waiting == 0 and all(r.future.cancelled() for r in (group[0], group[2]))
    assert [p[0] for c in engine.calls for p in c[0]] == [0]  # none of the group ran


def count_concurrent_calls(engine, counted=lambda state: True) -> dict:
    """Wrap ``engine.recommend`` to track the most calls running at once (``state["most"]``),
    counting only calls that start while ``counted(state)`` holds."""
    lock, state = threading.Lock(), {"now": 0, "most": 0}
    inner = engine.recommend

    def counting(*args, **kwargs):
        with lock:
            mine = counted(state)
            if mine:
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
        try:
            return inner(*args, **kwargs)
        finally:
            if mine:
                with lock:
                    state["now"] -= 1

    engine.recommend = counting
    return state


def test_batches_in_flight_run_concurrently_up_to_the_limit():
    engine = RecordingEngine(delay=0.1)
    state = count_concurrent_calls(engine)

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=2, max_inflight=2)
        batcher.start()
        answers = await run_concurrently(batcher, [request(i) for i in range(8)])
        await batcher.stop(drain=True)
        return answers

    started = time.perf_counter()
    answers = asyncio.run(scenario())
    assert [a.result.prompt_tokens for a in answers] == [3] * 8
    assert state["most"] == 2  # two engine calls at once, never three
    assert time.perf_counter() - started < 0.1 * 4 * 0.9  # 4 batches overlapped in pairs


class CancellingEngine(RecordingEngine):
    def recommend(self, prompts, **kwargs):
        time.sleep(0.1)
        raise asyncio.CancelledError()


def test_drain_never_leaves_a_request_hanging_when_the_engine_cancels():
    async def scenario():
        batcher = RequestBatcher(CancellingEngine(), max_inflight=2)
        batcher.start()
        pending = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)
        await batcher.stop(drain=True)
        return await asyncio.wait_for(pending, 2)

    with pytest.raises(XgrError):
        asyncio.run(scenario())


def test_a_restarted_scheduler_keeps_its_in_flight_limit():
    engine = RecordingEngine(delay=0.2)
    state = count_concurrent_calls(engine, counted=lambda state: state["restarted"])
    state["restarted"] = False

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=1, max_inflight=2)
        batcher.start()
        first = asyncio.ensure_future(run_concurrently(batcher, [request(i) for i in range(2)]))
        await asyncio.sleep(0.05)
        await batcher.stop()  # two batches were running: their slots must not leak
        state["restarted"] = True
        batcher.start()  # at once, as a restart would
        answers = await run_concurrently(batcher, [request(i) for i in range(6)])
        await batcher.stop(drain=True)
        await first
        return answers

    answers = asyncio.run(scenario())
    assert all(a.result.prompt_tokens == 3 for a in answers)
    assert state["most"] == 2


class PipelinedEngine:
    """Stands in for an engine with ``recommend_async``: a launch returns at once, each batch
    runs ``seconds`` on the simulated device and reports that as its device time. One stream
    runs the launched batches one after another; ``side_by_side`` (several streams) runs
    each as soon as it is launched.
    """

    max_in_flight = 2
    num_levels = 1

    def __init__(self, seconds: float, side_by_side: bool = False) -> None:
        self.seconds, self.side_by_side = seconds, side_by_side
        self.lock = threading.Lock()
        self.free_at = 0.0
        self.batches: list[list[int]] = []  # first token of each prompt, per launch
        self.in_flight = self.most_in_flight = 0
        self.seconds_of = lambda prompts: self.seconds  # a batch's run time (s)

    def recommend_async(self, prompts, beam_width, top_k, num_results, exclude_item_ids, **rules):
        with self.lock:
            now = time.perf_counter()
            end = (now if self.side_by_side else max(now, self.free_at)) + self.seconds_of(prompts)
            self.free_at = end
            self.batches.append([p[0] for p in prompts])
            self.in_flight += 1
            self.most_in_flight = max(self.most_in_flight, self.in_flight)
        engine, ms = self, self.seconds * 1e3

        class Pending:
            def result(self):
                time.sleep(max(0.0, end - time.perf_counter()))
                with engine.lock:
                    engine.in_flight -= 1
                return [
                    RecommendResult(prompt_tokens=len(p), prefill_ms=ms / 2, decode_ms=ms / 2)
                    for p in prompts
                ]

        return Pending()


def test_pipelined_launches_answer_a_burst_once_each_with_two_batches_in_flight():
    engine = PipelinedEngine(seconds=0.005)

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=16, max_inflight=2)
        batcher.start()
        burst = [QueuedRequest([i] * (1 + i % 5), 8, 8, 3) for i in range(300)]
        answers = await run_concurrently(batcher, burst)
        await batcher.stop()
        return burst, answers

    burst, answers = asyncio.run(scenario())
    assert [a.result.prompt_tokens for a in answers] == [len(r.prompt) for r in burst]
    assert sorted(t for batch in engine.batches for t in batch) == list(range(300))
    assert engine.most_in_flight == 2  # the next batch was launched while one ran


def test_the_next_pipelined_batch_is_formed_when_the_running_one_is_nearly_done():
    """Requests arriving while a batch runs join one batch launched just before it ends,
    not a batch of whichever arrived first."""
    engine = PipelinedEngine(seconds=0.3)

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=16, max_inflight=2)
        batcher.start()
        await batcher.submit(request(0))  # measures the batch time (0.3 s for 11 tokens)
        first = asyncio.ensure_future(batcher.submit(request(1)))
        await asyncio.sleep(0.02)
        later = []
        for i in range(2, 7):  # arrive within ~0.1 s of the 0.3 s the first batch runs
            later.append(asyncio.ensure_future(batcher.submit(request(i))))
            await asyncio.sleep(0.02)
        await asyncio.gather(first, *later)
        await batcher.stop()

    asyncio.run(scenario())
    assert engine.batches == [[0], [1], [2, 3, 4, 5, 6]]


def test_batches_finishing_together_on_several_streams_keep_their_measured_time():
    # Two batches launched together end together; the second is not "0 s behind the first".
    engine = PipelinedEngine(seconds=0.1, side_by_side=True)

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=2, max_inflight=4)
        batcher.start()
        await run_concurrently(batcher, [request(i) for i in range(8)])
        await batcher.stop()
        return batcher

    batcher = asyncio.run(scenario())
    assert len(batcher.latency.rates) >= 4
    assert batcher.latency.predict(22) >= 0.09  # two requests of 11 scheduled tokens


def numpy_request(i: int, deadline: float | None = None) -> QueuedRequest:
    # Same length and values but the first token: field-by-field equality of two such
    # requests would compare arrays, whose truth value is ambiguous.
    prompt = np.array([i, 1, 2, 3], dtype=np.int64)
    return QueuedRequest(prompt, 8, 8, 3, deadline=deadline)


def test_numpy_prompts_with_two_batches_in_flight_and_cancellations_keep_serving():
    # Side by side with unequal run times, a later batch often finishes first; clients go away
    # while their requests wait and while their batches run.
    engine = PipelinedEngine(seconds=0.004, side_by_side=True)
    engine.seconds_of = lambda prompts: 0.002 * (1 + int(prompts[0][0]) % 3)

    async def scenario():
        batcher = RequestBatcher(engine, max_batch_size=4, max_inflight=2)
        batcher.start()
        requests = [numpy_request(i % 7) for i in range(120)]
        tasks = []
        for i, r in enumerate(requests):
            tasks.append(asyncio.ensure_future(batcher.submit(r)))
            if i % 10 == 9:
                await asyncio.sleep(0.003)  # admitted; some waiting, some running
                for j in (i - 9, i - 4, i - 1):
                    tasks[j].cancel()
        # Bounded: a lane never released would leave the rest waiting for good.
        answers = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 20)
        # The scheduler still serves: every lane was released.
        after = await asyncio.wait_for(
            run_concurrently(batcher, [numpy_request(i) for i in range(10)]), 20
        )
        healthy, waiting = batcher.healthy, batcher.waiting
        await batcher.stop()
        return answers, after, healthy, waiting, batcher

    answers, after, healthy, waiting, batcher = asyncio.run(scenario())
    cancelled = [a for a in answers if isinstance(a, asyncio.CancelledError)]
    served = [a for a in answers if not isinstance(a, BaseException)]
    # A request answered before its cancellation counts as served.
    assert len(cancelled) + len(served) == 120 and len(cancelled) >= 24
    assert all(a.result.prompt_tokens == 4 for a in served)
    assert [a.result.prompt_tokens for a in after] == [4] * 10
    assert healthy and waiting == 0 and not batcher._batches
    assert engine.most_in_flight == 2


def test_a_failing_scheduling_loop_answers_the_waiting_and_says_so(monkeypatch):
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine)
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held
        waiting = [asyncio.ensure_future(batcher.submit(request(i))) for i in range(1, 4)]
        await asyncio.sleep(0.02)

        def broken(*args, **kwargs):
            raise RuntimeError("bookkeeping fault")

        monkeypatch.setattr(batcher, "_next_batch", broken)
        engine.release.set()
        outcomes = await asyncio.gather(*waiting, return_exceptions=True)
        await first
        with pytest.raises(SchedulerFailedError, match="bookkeeping fault"):
            await batcher.submit(request(9))
        healthy, failure = batcher.healthy, batcher.failure
        await batcher.stop()
        return outcomes, healthy, failure

    outcomes, healthy, failure = asyncio.run(scenario())
    assert all(isinstance(o, SchedulerFailedError) for o in outcomes)
    assert "RuntimeError: bookkeeping fault" in str(outcomes[0])
    assert not healthy and "bookkeeping fault" in failure


def test_a_group_larger_than_a_batch_lets_later_requests_in_between_its_batches():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine, max_batch_size=4)
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held
        group = asyncio.ensure_future(batcher.submit_all([request(i) for i in range(10, 22)]))
        await asyncio.sleep(0.01)
        small = asyncio.ensure_future(batcher.submit(request(99)))
        await asyncio.sleep(0.01)
        engine.release.set()
        await asyncio.gather(first, group, small)
        await batcher.stop()

    asyncio.run(scenario())
    firsts = [[p[0] for p in call[0]] for call in engine.calls]
    # The group's first share, then the request that came after it, before the group's rest.
    assert firsts[:2] == [[0], [10, 11, 12, 13]]
    assert 99 in firsts[2] and 14 in firsts[2]
    assert sorted(t for f in firsts for t in f) == [0, *range(10, 22), 99]
    assert len(firsts) == 5


def test_a_deadline_that_the_running_batch_and_its_own_run_would_miss_is_refused_at_once():
    engine = RecordingEngine()

    async def scenario():
        batcher = held_batcher(engine)
        batcher.latency.rates = [0.01]  # 11 scheduled tokens: 0.11 s a request
        first = asyncio.ensure_future(batcher.submit(request(0)))
        await asyncio.sleep(0.02)  # running, held: predicted to end ~0.09 s from now
        with pytest.raises(DeadlineExceededError, match="its own run"):
            await batcher.submit(request(9, deadline=time.perf_counter() + 0.15))
        roomy = asyncio.ensure_future(
            batcher.submit(request(8, deadline=time.perf_counter() + 0.5))
        )
        await asyncio.sleep(0.02)
        engine.release.set()
        await first, await roomy
        await batcher.stop()

    asyncio.run(scenario())
    assert [p[0] for c in engine.calls for p in c[0]] == [0, 8]
