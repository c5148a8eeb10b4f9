"""Serving over HTTP: the rate within P99 <= 200 ms over HTTP against in-process, and goodput
under overload (1.2x and 2x capacity), side by side in one run.

1. In-process: the server's scheduler and engine without HTTP (``xgr.bench``'s in-process
   load, as ``serving_throughput.py``), in a child process; open-loop Poisson rates rising
   x1.5 until P99 > 200 ms or > 1% errors, then two bisections: the highest rate that held.
2. HTTP: the same engine behind ``xgr serve``'s app and HTTP stack in a child process, the
   same sweep sent by a lean keep-alive client (``http_load.py``) from this process.
3. Fairness: the latency of small requests sent every 20 ms while one completion of 256
   prompts (a quarter of L tokens each) runs, against the same requests alone.
4. Overload: a server with a short queue (``--max-queue``); capacity is the 200s per second
   at 32 connections back to back; then Poisson load at 1.2x and 2x that (requests with
   ``--deadline-ms`` when given): the 200s per second as a fraction of capacity, P99 of the
   200s, the cores the load generator and the server kept busy, and every other outcome
   counted (429 queue full, 504 deadline, lost = no answer).

    python benchmarks/http_serving.py --output benchmarks/results/http-serving.json   # GPU
    python benchmarks/http_serving.py --tiny --output /tmp/http.json                   # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from xgr.bench import http_load  # noqa: E402
from xgr.bench.serve import LATENCY_BUDGET_MS as BUDGET_MS  # noqa: E402
from xgr.bench.serve import MAX_ERROR_FRACTION  # noqa: E402

RATE_STEP = 1.5  # as serving_throughput.py's sweep
SPREAD = 0.2  # prompt lengths within +-20% of L
OVERLOAD_CONNECTIONS = 32
WARM_S = 3.0  # an uncounted level at half the start rate before each measured one


def build_engine(args):
    """The benchmark's engine: a random-weight model of the shape and a random catalog."""
    import torch
    from e2e_latency import SHAPES, TINY, hf_model, random_catalog, sid_token_map, xgr_model

    from xgr import Engine

    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        torch.set_num_threads(1)
    model = xgr_model(hf_model(TINY if args.tiny else SHAPES[args.shape], device))
    catalog = random_catalog(args.items, 3)
    sid_map = sid_token_map(model.config.vocab_size, catalog.num_levels)
    engine = Engine(model, catalog, sid_map, name=args.shape)
    engine.warm_up(args.length, args.beam, args.beam, args.max_batch_size, SPREAD)
    return engine


def histories(args, count: int = 512) -> list[list[str]]:
    """Histories of about L / levels items (prompts of about L tokens), seeded."""
    from xgr.bench.serve import history_sampler

    sample = history_sampler([str(i) for i in range(args.items)], args.length // 3, 0, SPREAD)
    return [sample() for _ in range(count)]


def held(summary: dict) -> bool:
    errors = summary["requests"] - summary["ok"]
    p99 = summary["p99_ms"]
    return (
        p99 is not None and p99 <= BUDGET_MS and errors <= MAX_ERROR_FRACTION * summary["requests"]
    )


def sweep(measure, start_rate: float) -> dict:
    """``serving_throughput.rate_sweep`` over ``measure(rate)``, which returns a ``summary``
    dict: the points and the highest rate that kept the budget."""
    from serving_throughput import rate_sweep

    points = []

    def run(rate: float) -> bool:
        point = {"rate": rate, **measure(rate)}
        points.append(point)
        print(f"    {rate:8.1f}/s -> {point['ok_per_s']:8.1f}/s ok, P99 {point['p99_ms']}, "
              f"{point['statuses']}", flush=True)  # fmt: skip
        return held(point)

    rate_sweep(run, start_rate)
    best = max((p for p in points if held(p)), key=lambda p: p["rate"], default=None)
    return {
        "points": points,
        "max_rate_within_budget": best["rate"] if best else None,
        "throughput_within_budget": best["ok_per_s"] if best else None,
    }


def in_process_role(args) -> None:
    """Child process: the in-process sweep, written to ``--result``."""
    from xgr.bench.serve import LoadPlan, bench_in_process

    engine = build_engine(args)
    samples = histories(args)
    counter = iter(range(1 << 40))

    def measure(rate: float) -> dict:
        plan = LoadPlan(
            lambda: samples[next(counter) % len(samples)], args.beam, 10, None, [rate], [],
            args.duration,
        )  # fmt: skip
        (point,) = asyncio.run(bench_in_process(engine, plan, args.max_batch_size, progress=False))
        statuses = {"200": point.ok, **point.errors}
        return {
            "requests": point.requests, "ok": point.ok, "ok_per_s": point.throughput,
            "offered_per_s": point.requests / args.duration, "p50_ms": point.p50_ms,
            "p99_ms": point.p99_ms, "statuses": statuses,
        }  # fmt: skip

    result = sweep(measure, args.start_rate)
    Path(args.result).write_text(json.dumps(result))


def server_role(args) -> None:
    """Child process: ``xgr serve``'s app and HTTP stack over the benchmark's engine."""
    from xgr.server.app import create_app
    from xgr.server.config import ServerConfig
    from xgr.server.http import run_server

    engine = build_engine(args)
    config = ServerConfig(
        max_batch_size=args.max_batch_size, max_queue=args.max_queue, default_beam_width=64,
    )  # fmt: skip
    run_server(create_app(engine, config), "127.0.0.1", args.port)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, max_queue: int, log: Path):
    return start_child_server(__file__, ["--max-queue", str(max_queue), *child_args(args)], log)


def start_child_server(
    script: str, options: list[str], log: Path, timeout_s: float = 600
) -> tuple[subprocess.Popen, int]:
    """``script --role server --port PORT *options`` in a child process, its output in
    ``log``, once its ``/ready`` answers 200; the process and its port."""
    port = free_port()
    command = [sys.executable, script, "--role", "server", "--port", str(port), *options]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    end = time.time() + timeout_s
    while time.time() < end:
        if process.poll() is not None:
            raise SystemExit(f"the server exited ({process.returncode}): see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                if r.status == 200:
                    return process, port
        except OSError:
            time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not become ready within {timeout_s:g} s")


def child_args(args) -> list[str]:
    out = ["--shape", args.shape, "--length", str(args.length), "--beam", str(args.beam),
           "--items", str(args.items), "--max-batch-size", str(args.max_batch_size),
           "--duration", str(args.duration), "--start-rate", str(args.start_rate)]  # fmt: skip
    return out + (["--tiny"] if args.tiny else [])


def bodies(args, deadline_ms: float | None = None) -> list[dict]:
    extra = {"deadline_ms": deadline_ms} if deadline_ms else {}
    return [
        {"history": h, "beam_width": args.beam, "num_results": 10, **extra} for h in histories(args)
    ]


def cpu_seconds(pid: int | None = None) -> float:
    """CPU seconds (user + system) used so far by this process, or by process ``pid``."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def http_levels(
    port: int, args, plan, deadline_ms: float | None = None, server_pid: int | None = None
) -> list[dict]:
    """Run ``plan`` (a list of ("rate"|"concurrency", value)) against the server; each
    level also says how many cores the load generator and the server kept busy."""
    pool = http_load.Pool("127.0.0.1", port, timeout=30.0)
    requests = http_load.request_bytes("127.0.0.1", port, bodies(args, deadline_ms))
    await http_load.open_loop(pool, requests, args.start_rate / 2, WARM_S)  # not counted
    results = []
    for mode, value in plan:
        began = time.perf_counter()
        cpu = cpu_seconds(), cpu_seconds(server_pid) if server_pid else 0.0
        if mode == "rate":
            outcomes = await http_load.open_loop(pool, requests, value, args.duration)
        else:
            outcomes = await http_load.closed_loop(pool, requests, value, args.duration)
        window = (
            max(args.duration, time.perf_counter() - began) if mode != "rate" else args.duration
        )
        lost, pool.lost = pool.lost, {}
        summary = http_load.summary(outcomes, window)
        wall = time.perf_counter() - began
        summary["generator_cores"] = (cpu_seconds() - cpu[0]) / wall
        if server_pid:
            summary["server_cores"] = (cpu_seconds(server_pid) - cpu[1]) / wall
        results.append({"mode": mode, "load": value, **summary, "lost_reasons": lost})
        await asyncio.sleep(1.0)  # the queue empties before the next level
    pool.close()
    return results


async def fairness(port: int, args) -> dict:
    """Small requests' latency alone and while one 256-prompt completion runs."""
    import numpy as np

    small_pool = http_load.Pool("127.0.0.1", port, timeout=60.0)
    small = http_load.request_bytes("127.0.0.1", port, bodies(args))
    rng = np.random.default_rng(0)
    vocab_base = args.vocab - 3 * 256 if not args.tiny else 64
    prompts = rng.integers(1, vocab_base, (256, max(1, args.length // 4))).tolist()
    body = {"prompt": prompts, "n": 10, "beam_width": args.beam, "max_tokens": 3}
    (big,) = http_load.request_bytes("127.0.0.1", port, [body], "/v1/completions")
    big_pool = http_load.Pool("127.0.0.1", port, timeout=120.0)

    async def smalls(count: int, stop=None) -> list[float]:
        latencies = []
        for i in range(count):
            if stop is not None and stop.done():
                break
            began = time.perf_counter()
            status = await small_pool.send(small[i % len(small)])
            latencies.append((time.perf_counter() - began) * 1e3 if status == 200 else None)
            await asyncio.sleep(0.02)
        return latencies

    await smalls(5)
    alone = await smalls(20)
    began = time.perf_counter()
    completion = asyncio.ensure_future(big_pool.send(big))
    during = await smalls(10_000, completion)
    status = await completion
    took = (time.perf_counter() - began) * 1e3
    small_pool.close()
    big_pool.close()
    ok = [x for x in during if x is not None]
    return {
        "completion": {"prompts": 256, "prompt_tokens": len(prompts[0]), "status": status,
                       "ms": took},
        "small_alone_ms": {"p50": float(np.median(alone)), "max": float(max(alone))},
        "small_during_ms": {"count": len(during), "failed": len(during) - len(ok),
                            "p50": float(np.median(ok)) if ok else None,
                            "p90": float(np.percentile(ok, 90)) if ok else None,
                            "max": float(max(ok)) if ok else None},
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--length", type=int, default=1000, help="prompt tokens (+-20%%)")
    parser.add_argument("--beam", type=int, default=256)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-queue", type=int, default=16, help="the overload server's queue")
    parser.add_argument(
        "--deadline-ms", type=float, default=None, help="deadline_ms of the overload levels"
    )
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--start-rate", type=float, default=100.0)
    parser.add_argument("--parts", default="sweep,fairness,overload")
    parser.add_argument("--vocab", type=int, default=151936, help="the shape's vocabulary")
    parser.add_argument("--role", choices=["main", "server", "in-process"], default="main")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--result", default=None)
    args = parser.parse_args()
    if args.tiny and args.shape == "qwen2.5-0.5b":
        args.shape, args.items, args.length, args.beam = "tiny", 2000, 60, 16
    if args.role == "server":
        return server_role(args)
    if args.role == "in-process":
        return in_process_role(args)
    if args.output is None:
        parser.error("--output is required")
    from timing import run_environment

    report = {
        "benchmark": "HTTP serving: rate within P99 <= 200 ms against in-process; overload",
        **run_environment("cpu" if args.tiny else "cuda"),
        "shape": args.shape, "prompt_len": args.length, "beam_width": args.beam,
        "items": args.items, "max_batch_size": args.max_batch_size,
        "duration_s_per_level": args.duration,
    }  # fmt: skip
    parts = args.parts.split(",")
    logs = Path(tempfile.mkdtemp(prefix="xgr-http-"))
    if "sweep" in parts:
        print("in-process sweep", flush=True)
        result = logs / "in-process.json"
        subprocess.run(
            [sys.executable, __file__, "--role", "in-process", "--result", str(result),
             *child_args(args)], check=True,
        )  # fmt: skip
        report["in_process"] = json.loads(result.read_text())
        print("HTTP sweep", flush=True)
        server, port = start_server(args, 4096, logs / "server-sweep.log")
        try:
            start = report["in_process"]["max_rate_within_budget"] or args.start_rate

            def measure(rate: float) -> dict:
                (point,) = asyncio.run(
                    http_levels(port, args, [("rate", rate)], server_pid=server.pid)
                )
                return point

            report["http"] = sweep(measure, start / RATE_STEP)
        finally:
            server.terminate()
            server.wait(60)
        inner = report["in_process"]["throughput_within_budget"]
        outer = report["http"]["throughput_within_budget"]
        report["http_over_in_process"] = outer / inner if inner and outer else None
    if "fairness" in parts:
        print("fairness", flush=True)
        server, port = start_server(args, 4096, logs / "server-fairness.log")
        try:
            report["fairness"] = asyncio.run(fairness(port, args))
        finally:
            server.terminate()
            server.wait(60)
    if "overload" in parts:
        print(f"overload (queue {args.max_queue})", flush=True)
        server, port = start_server(args, args.max_queue, logs / "server-overload.log")
        try:
            (capacity,) = asyncio.run(
                http_levels(
                    port, args, [("concurrency", OVERLOAD_CONNECTIONS)], server_pid=server.pid
                )
            )
            rate = capacity["ok_per_s"]
            plan = [("rate", 1.2 * rate), ("rate", 2 * rate)]
            levels = asyncio.run(http_levels(port, args, plan, args.deadline_ms, server.pid))
        finally:
            server.terminate()
            server.wait(60)
        report["overload"] = {
            "max_queue": args.max_queue,
            "deadline_ms": args.deadline_ms,
            "capacity": capacity,
            "levels": [{**level, "ok_over_capacity": level["ok_per_s"] / rate} for level in levels],
        }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print("\nresult")
    if "http_over_in_process" in report:
        inner = report["in_process"]["throughput_within_budget"]
        outer = report["http"]["throughput_within_budget"]
        print(f"  within P99 {BUDGET_MS:.0f} ms: in-process {inner}, HTTP {outer} req/s, "
              f"ratio {report['http_over_in_process']}")  # fmt: skip
    if "fairness" in report:
        f = report["fairness"]
        print(f"  completion of 256 prompts: {f['completion']['ms']:.0f} ms "
              f"({f['completion']['status']}); small requests alone p50 "
              f"{f['small_alone_ms']['p50']:.1f} ms, during it p50 "
              f"{f['small_during_ms']['p50']:.1f} p90 {f['small_during_ms']['p90']:.1f} max "
              f"{f['small_during_ms']['max']:.1f} ms")  # fmt: skip
    if "overload" in report:
        cap = report["overload"]["capacity"]
        print(
            f"  capacity {cap['ok_per_s']:.1f} req/s (P99 {cap['p99_ms']:.1f} ms; cores busy: "
            f"generator {cap['generator_cores']:.2f}, server {cap['server_cores']:.2f})"
        )
        for level in report["overload"]["levels"]:
            print(
                f"  {level['load']:.0f}/s offered: {level['ok_per_s']:.1f} ok/s "
                f"({level['ok_over_capacity']:.2f} of capacity), P99 {level['p99_ms']:.1f} ms, "
                f"{level['statuses']} {level['lost_reasons']}; cores busy: generator "
                f"{level['generator_cores']:.2f}, server {level['server_cores']:.2f}"
            )


if __name__ == "__main__":
    main()
