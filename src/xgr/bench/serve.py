"""``xgr bench serve``: load levels against a server (HTTP) or the engine in-process, reported
as JSON and as a latency-vs-throughput plot."""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from xgr.bench.load import (
    LoadPoint,
    Send,
    check_levels,
    fixed_concurrency,
    open_loop,
    summarize,
)
from xgr.core import XgrError

if TYPE_CHECKING:
    from xgr.engine import Engine

# The latency budget recommendation services hold to (P99, ms), drawn on the plot.
LATENCY_BUDGET_MS = 200.0
# A level counts as within budget only if at most this fraction of its requests failed.
MAX_ERROR_FRACTION = 0.01


def history_sampler(
    item_ids: Sequence[str], length: int, seed: int, spread: float = 0.0
) -> Callable[[], list[str]]:
    """Random histories of about ``length`` distinct items from the catalog.

    Args:
        item_ids: the catalog's item ids.
        length: items per history.
        seed: random seed.
        spread: each history's length is drawn uniformly within length x (1 +- spread).

    Raises:
        XgrError: a length outside 1..catalog size (after the spread) or spread not in [0, 1).
    """
    if not 0 <= spread < 1:
        raise XgrError(f"spread must be in [0, 1), got {spread}")
    low, high = max(1, round(length * (1 - spread))), round(length * (1 + spread))
    if length < 1 or high > len(item_ids):
        raise XgrError(f"history length must be 1..{len(item_ids)}, got {length} (+-{spread:.0%})")
    rng = random.Random(seed)
    items = list(item_ids)  # once: sampling from a sequence needs no copy per history
    return lambda: rng.sample(items, rng.randint(low, high))


def http_sender(
    client: Any,
    beam_width: int,
    num_results: int,
    deadline_ms: int | None,
    first_errors: dict[str, str] | None = None,
) -> Send:
    """Requests to ``POST /v1/recommend`` through an ``httpx.AsyncClient`` (base URL set).

    ``first_errors``, if given, receives the first response body (up to 300 characters) of
    each error status, so a run that fails can say why.
    """

    async def send(history: list[str]) -> str:
        body: dict[str, Any] = {
            "history": history,
            "beam_width": beam_width,
            "num_results": num_results,
        }
        if deadline_ms:
            body["deadline_ms"] = deadline_ms
        response = await client.post("/v1/recommend", json=body)
        if response.status_code == 200:
            return "ok"
        label = str(response.status_code)
        if first_errors is not None and label not in first_errors:
            first_errors[label] = response.text[:300]
        return label

    return send


def engine_sender(
    batcher: Any, engine: Engine, beam_width: int, num_results: int, deadline_ms: int | None
) -> Send:
    """Requests straight into a running ``RequestBatcher`` (the server's path without HTTP).

    Refusals are labelled with the HTTP status the server would give (``http_status``).
    """
    import time

    from xgr.scheduler import QueuedRequest, http_status

    async def send(history: list[str]) -> str:
        arrived = time.perf_counter()
        prompt = engine.tokenize(engine.history_prompt(history, truncate=True))
        deadline = arrived + deadline_ms / 1e3 if deadline_ms else None
        request = QueuedRequest(
            prompt, beam_width, beam_width, num_results, frozenset(history), deadline, arrived
        )
        try:
            await batcher.submit(request)
        except XgrError as exc:  # labelled as the server would answer it
            return str(http_status(exc))
        return "ok"

    return send


async def run_levels(
    send: Send,
    histories: Callable[[], list[str]],
    rates: Sequence[float],
    concurrencies: Sequence[int],
    duration: float,
    seed: int = 0,
    progress: bool = True,
) -> list[LoadPoint]:
    """Each rate (open loop) and each concurrency level in turn, ``duration`` s apiece.

    Raises:
        XgrError: an unusable level (checked for all levels before the first runs).
    """
    check_levels(rates, concurrencies, duration)
    points = []
    levels = [("rate", r) for r in rates] + [("concurrency", c) for c in concurrencies]
    for mode, load in levels:
        expected = int(load * duration) if mode == "rate" else None
        with tqdm(total=expected, desc=f"{mode} {load:g}", unit="req", disable=not progress) as bar:
            if mode == "rate":
                samples = await open_loop(send, histories, load, duration, seed, bar.update)
            else:
                samples = await fixed_concurrency(send, histories, int(load), duration, bar.update)
            # Poisson arrivals: rate x duration was only the expected count.
            bar.total = bar.n
            bar.refresh()
        points.append(summarize(mode, load, samples, duration))
    return points


def within_budget(point: LoadPoint) -> bool:
    """P99 of the successful requests <= 200 ms, and at most 1% of requests failed (refusals
    are not fast answers)."""
    failed = point.requests - point.ok
    return (
        point.p99_ms is not None
        and point.p99_ms <= LATENCY_BUDGET_MS
        and failed <= MAX_ERROR_FRACTION * point.requests
    )


def write_report(points: list[LoadPoint], settings: dict[str, Any], path: Path) -> dict:
    """The JSON report: settings, one entry per load level, and the best throughput among
    the levels ``within_budget``."""
    within = [p for p in points if within_budget(p)]
    report = {
        "settings": settings,
        "latency_budget_ms": LATENCY_BUDGET_MS,
        "points": [dataclasses.asdict(p) for p in points],
        "max_error_fraction": MAX_ERROR_FRACTION,
        "max_throughput_within_budget": max((p.throughput for p in within), default=None),
    }
    path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def plot(points: list[LoadPoint], path: Path, title: str) -> None:
    """P50 and P99 latency against achieved throughput, one line per mode, in the format
    of ``path``'s suffix (PNG, SVG or PDF)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode in ("rate", "concurrency"):
        series = sorted(
            (p for p in points if p.mode == mode and p.p99_ms is not None),
            key=lambda p: p.throughput,
        )
        if not series:
            continue
        x = [p.throughput for p in series]
        label = "open loop" if mode == "rate" else "fixed concurrency"
        ax.plot(x, [p.p99_ms for p in series], "o-", label=f"P99, {label}")
        ax.plot(x, [p.p50_ms for p in series], "s--", label=f"P50, {label}", alpha=0.7)
    ax.axhline(LATENCY_BUDGET_MS, color="grey", linestyle=":", label="200 ms budget")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("latency (ms)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class LoadPlan:
    """What a benchmark sends: request shape and the load levels.

    Attributes:
        histories: returns one random history (item ids) per call.
        beam_width, num_results: search parameters of every request.
        deadline_ms: per-request deadline, or None.
        rates: open-loop Poisson rates (requests/s). concurrencies: fixed client counts.
        duration: seconds per load level.
    """

    histories: Callable[[], list[str]]
    beam_width: int
    num_results: int
    deadline_ms: int | None
    rates: Sequence[float]
    concurrencies: Sequence[int]
    duration: float


async def bench_in_process(
    engine: Engine,
    plan: LoadPlan,
    max_batch_size: int,
    max_batch_ms: float | None = None,
    progress: bool = True,
) -> list[LoadPoint]:
    """The plan's levels against ``engine`` through a ``RequestBatcher`` in this process
    (``max_batch_size`` and ``max_batch_ms`` as the batcher's)."""
    from xgr.scheduler import RequestBatcher
    from xgr.server.app import freeze_long_lived_objects

    freeze_long_lived_objects()  # as the server does once it has warmed up
    batcher = RequestBatcher(
        engine,
        max_batch_size,
        max_inflight=engine.max_in_flight,
        max_batch_ms=max_batch_ms,
    )
    batcher.start()
    try:
        send = engine_sender(batcher, engine, plan.beam_width, plan.num_results, plan.deadline_ms)
        return await _levels(send, plan, progress)
    finally:
        await batcher.stop(drain=True)


async def bench_http(
    url: str, plan: LoadPlan, progress: bool = True, first_errors: dict[str, str] | None = None
) -> list[LoadPoint]:
    """The plan's levels against a running ``xgr serve`` at ``url`` (``first_errors`` as
    ``http_sender``'s)."""
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        send = http_sender(
            client, plan.beam_width, plan.num_results, plan.deadline_ms, first_errors
        )
        return await _levels(send, plan, progress)


async def _levels(send: Send, plan: LoadPlan, progress: bool) -> list[LoadPoint]:
    return await run_levels(
        send, plan.histories, plan.rates, plan.concurrencies, plan.duration, progress=progress
    )
