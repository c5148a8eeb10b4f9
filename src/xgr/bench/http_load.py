"""A lean HTTP/1.1 load generator for overload and HTTP-path measurements: open-loop Poisson
arrivals or fixed concurrency against ``POST /v1/recommend``, over keep-alive connections.

Request bytes are encoded before the run and a response is read as its status line, headers
and ``content-length`` bytes, so the generator spends a few tens of microseconds per request
and does not itself become the bottleneck of the machine it shares with the server (an
``httpx`` client costs several times more per request). Every request ends as a status code
or as ``lost`` (no answer: refused connection, reset, or no response within the timeout).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Outcome:
    """One request: scheduled start (s from the level's start), latency (s), status (0: lost)."""

    start: float
    latency: float
    status: int


def request_bytes(
    host: str, port: int, bodies: list[dict], path: str = "/v1/recommend"
) -> list[bytes]:
    """Each body as a complete ``POST`` request to ``path``."""
    encoded = []
    for body in bodies:
        payload = json.dumps(body).encode()
        head = (
            f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(payload)}\r\n\r\n"
        )
        encoded.append(head.encode() + payload)
    return encoded


class Pool:
    """Keep-alive connections to one server, opened on demand and reused."""

    def __init__(self, host: str, port: int, timeout: float) -> None:
        self.host, self.port, self.timeout = host, port, timeout
        self.idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self.lost: dict[str, int] = {}  # why requests got no answer: exception name -> count

    async def send(self, data: bytes) -> int:
        """Send one request; its status, or 0 when it got no answer."""
        try:
            return await asyncio.wait_for(self._exchange(data), self.timeout)
        except (TimeoutError, OSError, asyncio.IncompleteReadError, ValueError) as exc:
            name = type(exc).__name__
            self.lost[name] = self.lost.get(name, 0) + 1
            return 0

    async def _exchange(self, data: bytes) -> int:
        if self.idle:
            reader, writer = self.idle.pop()
            try:
                return await self._on(reader, writer, data)
            except asyncio.IncompleteReadError as exc:
                if exc.partial:
                    raise
                # The server closed the kept-alive connection while it was idle (its
                # keep-alive timeout): as HTTP clients do, send again on a new one.
        reader, writer = await asyncio.open_connection(self.host, self.port)
        return await self._on(reader, writer, data)

    async def _on(self, reader, writer, data: bytes) -> int:
        try:
            writer.write(data)
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            status = int(lines[0].split(b" ", 2)[1])
            headers = dict(
                line.split(b":", 1) for line in lines[1:] if b":" in line
            )  # fmt: skip
            headers = {k.strip().lower(): v.strip().lower() for k, v in headers.items()}
            await reader.readexactly(int(headers.get(b"content-length", b"0")))
        except BaseException:
            writer.close()
            raise
        if headers.get(b"connection") == b"close":
            writer.close()
        else:
            self.idle.append((reader, writer))
        return status

    def close(self) -> None:
        for _, writer in self.idle:
            writer.close()
        self.idle.clear()


async def _timed(pool: Pool, data: bytes, origin: float, scheduled: float, out: list) -> None:
    status = await pool.send(data)
    out.append(Outcome(scheduled - origin, time.perf_counter() - scheduled, status))


async def open_loop(
    pool: Pool, requests: list[bytes], rate: float, duration: float, seed: int = 0
) -> list[Outcome]:
    """Poisson arrivals at ``rate`` requests/s for ``duration`` s; waits for every answer.
    Latency counts from the scheduled arrival, so a late start is counted as waiting."""
    rng = random.Random(seed)
    out: list[Outcome] = []
    tasks = []
    origin = time.perf_counter()
    at = rng.expovariate(rate)
    i = 0
    while at < duration:
        await asyncio.sleep(max(0.0, origin + at - time.perf_counter()))
        data = requests[i % len(requests)]
        tasks.append(asyncio.ensure_future(_timed(pool, data, origin, origin + at, out)))
        i += 1
        at += rng.expovariate(rate)
    await asyncio.gather(*tasks)
    return out


async def closed_loop(
    pool: Pool, requests: list[bytes], concurrency: int, duration: float
) -> list[Outcome]:
    """``concurrency`` clients, each sending its next request when its last one returns."""
    out: list[Outcome] = []
    origin = time.perf_counter()

    async def client(k: int) -> None:
        i = k
        while time.perf_counter() - origin < duration:
            await _timed(pool, requests[i % len(requests)], origin, time.perf_counter(), out)
            i += concurrency

    await asyncio.gather(*(client(k) for k in range(concurrency)))
    return out


def summary(outcomes: list[Outcome], window: float) -> dict:
    """Counts per status, 200s per second over ``window`` s, and latency percentiles (ms)
    of the 200s."""
    ok = np.array([o.latency for o in outcomes if o.status == 200]) * 1e3
    statuses: dict[str, int] = {}
    for o in outcomes:
        label = "lost" if o.status == 0 else str(o.status)
        statuses[label] = statuses.get(label, 0) + 1
    pct = (lambda q: float(np.percentile(ok, q))) if ok.size else (lambda q: None)
    return {
        "requests": len(outcomes),
        "ok": int(ok.size),
        "ok_per_s": ok.size / window,
        "offered_per_s": len(outcomes) / window,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "statuses": statuses,
    }
