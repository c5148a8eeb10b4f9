"""Load generation against a recommendation service: open-loop Poisson arrivals or fixed
concurrency, through HTTP or in-process (the scheduler and engine without HTTP).

Open loop: requests start at the times of a Poisson process of the given rate, whether or not
earlier ones have finished, as independent users do; the latency figures then include queueing
under that load (a closed loop would hide it by slowing down with the server). Fixed
concurrency: N clients each send their next request when the previous one returns.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import numpy as np

from xgr.core import XgrError

# One request: returns an outcome label ("ok", or an error such as "429", "504", "Timeout").
Send = Callable[[list[str]], Awaitable[str]]


@dataclass
class Sample:
    """One request of a load run: when it started (s from the run's start), its latency (s)
    and its outcome ("ok" or an error label)."""

    start: float
    latency: float
    outcome: str


@dataclass
class LoadPoint:
    """The figures of one load level.

    Attributes:
        mode: "rate" (open-loop Poisson) or "concurrency".
        load: offered rate (requests/s) or number of concurrent clients.
        duration_s: the level's sending window, or, when longer, the time from the first
            request's start to the last one's end (s).
        requests: requests sent. ok: answered successfully.
        throughput: successful answers per second over duration_s.
        p50_ms, p95_ms, p99_ms: latency percentiles of the successful requests (ms); None
            when none succeeded.
        errors: count per error label.
    """

    mode: str
    load: float
    duration_s: float
    requests: int
    ok: int
    throughput: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    errors: dict[str, int]


def summarize(mode: str, load: float, samples: list[Sample], window_s: float = 0.0) -> LoadPoint:
    """Percentiles, throughput and error counts of one load level's samples.

    Args:
        window_s: how long the level sent requests (s). Throughput is counted over at least
            that: a sparse level (one request in a 4 s window) is not its latency's inverse.

    Raises:
        XgrError: no samples.
    """
    if not samples:
        raise XgrError("no requests were sent")
    begin = min(s.start for s in samples)
    end = max(s.start + s.latency for s in samples)
    duration = max(end - begin, window_s, 1e-9)
    ok = [s.latency * 1e3 for s in samples if s.outcome == "ok"]
    errors: dict[str, int] = {}
    for s in samples:
        if s.outcome != "ok":
            errors[s.outcome] = errors.get(s.outcome, 0) + 1
    pct = (lambda q: float(np.percentile(ok, q))) if ok else (lambda q: None)
    return LoadPoint(
        mode, load, duration, len(samples), len(ok), len(ok) / duration,
        pct(50), pct(95), pct(99), errors,
    )  # fmt: skip


# Highest open-loop rate accepted (requests/s): beyond it the generator itself is the limit.
MAX_RATE = 100_000.0


def check_levels(rates, concurrencies, duration: float) -> None:
    """Refuse unusable load levels before any runs.

    Raises:
        XgrError: a rate not in (0, MAX_RATE], a concurrency < 1, a duration not in (0, 1 day].
    """
    if not 0 < duration <= 86_400:
        raise XgrError(f"duration must be in (0, 86400] seconds, got {duration}")
    for rate in rates:
        if not (math.isfinite(rate) and 0 < rate <= MAX_RATE):
            raise XgrError(f"rate must be in (0, {MAX_RATE:g}] requests/s, got {rate}")
    for concurrency in concurrencies:
        if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
            raise XgrError(f"concurrency must be an integer >= 1, got {concurrency!r}")


async def _timed(
    send: Send,
    history: list[str],
    origin: float,
    samples: list[Sample],
    scheduled: float | None = None,
) -> None:
    # Latency counts from the scheduled arrival when there is one: a late start is the
    # generator's or the host's delay, and users would have waited through it.
    start = time.perf_counter() if scheduled is None else scheduled
    try:
        outcome = await send(history)
    except Exception as exc:  # a failed request is a data point, not the end of the run
        outcome = type(exc).__name__
    samples.append(Sample(start - origin, time.perf_counter() - start, outcome))


async def open_loop(
    send: Send,
    histories: Callable[[], list[str]],
    rate: float,
    duration: float,
    seed: int = 0,
    on_done: Callable[[], None] | None = None,
) -> list[Sample]:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` seconds; waits for all answers.

    Raises:
        XgrError: a rate or duration <= 0.
    """
    check_levels([rate], [], duration)
    rng = random.Random(seed)
    samples: list[Sample] = []
    tasks = []
    origin = time.perf_counter()
    next_start = rng.expovariate(rate)
    while next_start < duration:
        # Sleeping (even for 0 s) lets started requests run while later ones are scheduled.
        await asyncio.sleep(max(0.0, origin + next_start - time.perf_counter()))
        task = asyncio.ensure_future(
            _timed(send, histories(), origin, samples, origin + next_start)
        )
        if on_done is not None:
            task.add_done_callback(lambda _: on_done())
        tasks.append(task)
        next_start += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return samples


async def fixed_concurrency(
    send: Send,
    histories: Callable[[], list[str]],
    concurrency: int,
    duration: float,
    on_done: Callable[[], None] | None = None,
) -> list[Sample]:
    """``concurrency`` clients sending back to back for ``duration`` seconds.

    Raises:
        XgrError: concurrency < 1 or duration <= 0.
    """
    check_levels([], [concurrency], duration)
    samples: list[Sample] = []
    origin = time.perf_counter()

    async def client() -> None:
        while time.perf_counter() - origin < duration:
            await _timed(send, histories(), origin, samples)
            if on_done is not None:
                on_done()
            await asyncio.sleep(0)  # an instant refusal must not starve the other clients

    await asyncio.gather(*(client() for _ in range(concurrency)))
    return samples
