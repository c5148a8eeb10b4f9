"""The batch policy as plain functions: which waiting requests form the next batch."""

from __future__ import annotations

import asyncio

import pytest

from xgr.scheduler.batch_policy import form_batch, live_requests
from xgr.scheduler.requests import DeadlineExceededError, LatencyModel, QueuedRequest


def request(tokens, beam=4, deadline=None, arrived=0.0):
    return QueuedRequest([1] * tokens, beam, beam, 1, deadline=deadline, arrived=arrived)


def cost(r):
    return len(r.prompt) + 3 * r.beam_width  # three levels


def latency(seconds_per_token):
    model = LatencyModel()
    model.observe(1000, 1000 * seconds_per_token)
    return model


def form(queue, start=0.0, seconds_per_token=0.0, size=8, tokens=10_000, batch_ms=None):
    return form_batch(queue, cost, start, latency(seconds_per_token), size, tokens, batch_ms)


def test_the_oldest_request_sets_the_beam_and_younger_ones_never_jump_ahead():
    queue = [request(10), request(10, beam=8), request(10), request(500), request(10)]
    batch, tokens = form(queue, tokens=100)
    # The beam-8 request waits; the 500-token one does not fit, and the one after it may not
    # pass it.
    assert batch == [queue[0], queue[2]] and tokens == 2 * (10 + 12)
    assert form(queue, size=1)[0] == [queue[0]]
    assert form([queue[3]], tokens=100)[0] == [queue[3]]  # too large, but alone: it runs


def test_the_newest_leave_until_the_earliest_deadline_and_the_time_cap_hold():
    queue = [request(88, deadline=1.0), request(88), request(88, deadline=5.0)]
    # 100 scheduled tokens each at 4 ms a token: 0.4 s a request.
    assert form(queue, seconds_per_token=4e-3)[0] == queue[:2]  # 0.8 s <= 1.0 s
    assert form(queue, start=0.5, seconds_per_token=4e-3)[0] == queue[:1]  # down to one
    assert form(queue, seconds_per_token=4e-3, batch_ms=500)[0] == queue[:1]
    assert form(queue, seconds_per_token=0.0)[0] == queue  # nothing measured yet


def test_live_requests_drop_withdrawn_ones_and_answer_the_late_with_504():
    loop = asyncio.new_event_loop()
    try:
        queue = [request(5, deadline=1.0, arrived=0.5), request(5), request(5, deadline=9.0)]
        for r in queue:
            r.future = loop.create_future()
        queue[1].future.cancel()  # the client went away
        assert live_requests(queue, now=2.0) == [queue[2]]
        with pytest.raises(DeadlineExceededError, match="1500 ms in the queue"):
            queue[0].future.result()
    finally:
        loop.close()
