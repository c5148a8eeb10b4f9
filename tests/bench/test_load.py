"""The load generator: arrival processes, summaries, and ``xgr bench serve`` end to end."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest
from click.testing import CliRunner

from tests.conftest import live_server
from xgr.bench.load import Sample, fixed_concurrency, open_loop, summarize
from xgr.cli import main
from xgr.core import XgrError


class FakeService:
    """Answers after ``delay`` seconds; tracks how many requests are in flight at once."""

    def __init__(self, delay: float, fail_every: int = 0) -> None:
        self.delay, self.fail_every = delay, fail_every
        self.in_flight = self.most_in_flight = self.calls = 0

    async def send(self, history):
        self.calls += 1
        call = self.calls
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            if self.fail_every and call % self.fail_every == 0:
                raise TimeoutError("slow")
            return "ok" if call % 5 else "429"
        finally:
            self.in_flight -= 1


def test_summary_percentiles_throughput_and_errors():
    samples = [Sample(i * 0.1, 0.01 * (i + 1), "ok") for i in range(10)]
    samples.append(Sample(0.05, 0.2, "504"))
    point = summarize("rate", 10.0, samples)
    assert (point.requests, point.ok, point.errors) == (11, 10, {"504": 1})
    assert point.duration_s == pytest.approx(0.9 + 0.1)
    assert point.throughput == pytest.approx(10 / 1.0)
    assert point.p50_ms == pytest.approx(55.0)
    assert point.p99_ms == pytest.approx(99.1)
    with pytest.raises(XgrError, match="no requests"):
        summarize("rate", 1.0, [])
    assert summarize("rate", 1.0, [Sample(0, 1, "503")]).p99_ms is None


def test_a_sparse_level_counts_throughput_over_its_whole_window():
    # One request answered in 37 ms during a 4 s level: 0.25 req/s, not 1 / 37 ms.
    point = summarize("rate", 0.5, [Sample(1.2, 0.037, "ok")], window_s=4.0)
    assert point.duration_s == 4.0 and point.throughput == pytest.approx(0.25)
    # A level whose answers end after its window is counted to its last answer.
    late = summarize("rate", 10.0, [Sample(0.0, 0.5, "ok"), Sample(0.9, 0.6, "ok")], 1.0)
    assert late.duration_s == pytest.approx(1.5)


def test_open_loop_follows_the_poisson_schedule_without_waiting_for_answers():
    service = FakeService(delay=0.2)
    rate, duration, seed = 80.0, 0.5, 3
    samples = asyncio.run(open_loop(service.send, lambda: ["1"], rate, duration, seed))
    rng, arrivals, t = random.Random(seed), 0, 0.0
    while (t := t + rng.expovariate(rate)) < duration:
        arrivals += 1
    assert len(samples) == arrivals > 10
    assert max(s.start for s in samples) < duration + 0.05  # starts never wait for answers
    assert service.most_in_flight > 5  # many outstanding at once: an open loop
    assert {s.outcome for s in samples} == {"ok", "429"}
    assert all(s.latency >= 0.2 for s in samples)


def test_fixed_concurrency_keeps_that_many_in_flight_and_records_failures():
    service = FakeService(delay=0.01, fail_every=7)
    samples = asyncio.run(fixed_concurrency(service.send, lambda: ["1"], 3, 0.3))
    assert service.most_in_flight == 3
    assert 30 <= len(samples) <= 100
    assert sum(s.outcome == "TimeoutError" for s in samples) == len(samples) // 7
    with pytest.raises(XgrError, match="concurrency"):
        asyncio.run(fixed_concurrency(service.send, lambda: ["1"], 0, 1.0))


@pytest.fixture(scope="module")
def engine(served_model_dir):
    from xgr import Engine

    return Engine.from_pretrained(served_model_dir)


def check_outputs(result, path):
    assert result.exit_code == 0, result.output
    report = json.loads(path.read_text())
    point = report["points"][0]
    assert point["ok"] == point["requests"] > 0 and point["errors"] == {}
    assert point["p50_ms"] <= point["p95_ms"] <= point["p99_ms"]
    assert path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "P99" in result.output and "wrote" in result.output
    return report


def test_bench_serve_in_process(tmp_path, served_model_dir):
    out = tmp_path / "in-process.json"
    result = CliRunner().invoke(
        main,
        ["bench", "serve", "--model", str(served_model_dir), "--rate", "30", "--concurrency",
         "2", "--duration", "1", "--beam-width", "8", "--num-results", "4", "--output", str(out)],
    )  # fmt: skip
    report = check_outputs(result, out)
    assert [p["mode"] for p in report["points"]] == ["rate", "concurrency"]
    assert report["settings"]["target"] == "in-process"


def test_bench_serve_over_http(tmp_path, served_model_dir, engine):
    from xgr.server.app import create_app

    out = tmp_path / "http.json"
    with live_server(create_app(engine)) as url:
        result = CliRunner().invoke(
            main,
            ["bench", "serve", "--model", str(served_model_dir), "--url", url, "--rate", "20",
             "--duration", "1", "--beam-width", "8", "--num-results", "4", "--output", str(out)],
        )  # fmt: skip
    report = check_outputs(result, out)
    assert report["settings"]["target"] == url


def test_bench_serve_needs_a_load_level(served_model_dir, tmp_path):
    result = CliRunner().invoke(
        main, ["bench", "serve", "--model", str(served_model_dir), "--output", str(tmp_path / "x")]
    )
    assert result.exit_code != 0 and "--rate or --concurrency" in result.output


@pytest.mark.parametrize(
    ("rates", "concurrencies", "duration", "message"),
    [
        ([float("inf")], [], 1.0, "rate must be"),
        ([float("nan")], [], 1.0, "rate must be"),
        ([1e300], [], 1.0, "rate must be"),
        ([0.0], [], 1.0, "rate must be"),
        ([10.0], [0], 1.0, "concurrency must be"),  # checked before the rate level runs
        ([10.0], [], 0.0, "duration must be"),
    ],
)
def test_unusable_levels_are_refused_before_any_run(rates, concurrencies, duration, message):
    from xgr.bench.serve import run_levels

    service = FakeService(delay=0.0)
    with pytest.raises(XgrError, match=message):
        asyncio.run(run_levels(service.send, lambda: ["1"], rates, concurrencies, duration))
    assert service.calls == 0


def test_budget_needs_fast_answers_and_few_errors(tmp_path):
    from xgr.bench.load import LoadPoint
    from xgr.bench.serve import write_report

    fast_but_refused = LoadPoint("rate", 100, 1.0, 100, 10, 10.0, 20.0, 30.0, 40.0, {"429": 90})
    clean = LoadPoint("rate", 50, 1.0, 50, 50, 50.0, 20.0, 60.0, 150.0, {})
    slow = LoadPoint("rate", 80, 1.0, 80, 80, 80.0, 150.0, 200.0, 250.0, {})
    report = write_report([fast_but_refused, clean, slow], {}, tmp_path / "r.json")
    assert report["max_throughput_within_budget"] == 50.0


def test_open_loop_latency_counts_from_the_scheduled_arrival():
    async def blocking_send(history):
        time.sleep(0.05)  # blocks the event loop: later arrivals start late
        return "ok"

    samples = asyncio.run(open_loop(blocking_send, lambda: ["1"], 200.0, 0.2, seed=1))
    assert len(samples) > 10
    assert max(s.latency for s in samples) > 0.2  # waiting behind the blocked loop counts


def test_http_sender_keeps_the_first_answer_of_each_error_status():
    import httpx

    from xgr.bench.serve import http_sender

    answers = iter([(400, "beam_width 600 exceeds the limit 512"), (400, "again"), (200, "{}"),
                    (429, "queue full")])  # fmt: skip

    def reply(request):
        status, text = next(answers)
        return httpx.Response(status, text=text)

    async def run():
        transport = httpx.MockTransport(reply)
        async with httpx.AsyncClient(base_url="http://stub", transport=transport) as client:
            first = {}
            send = http_sender(client, 600, 10, None, first)
            outcomes = [await send(["1"]) for _ in range(4)]
        return outcomes, first

    outcomes, first = asyncio.run(run())
    assert outcomes == ["400", "400", "ok", "429"]
    assert first == {"400": "beam_width 600 exceeds the limit 512", "429": "queue full"}
