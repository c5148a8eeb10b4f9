"""A catalog update while the server is under load: P99 latency before, during and after an
update that adds and removes items, and the time until the new version serves.

1. ``xgr serve``'s app and HTTP stack in a child process over a random-weight model of the
   shape and a random catalog (1M items, 3 x 256 codes), with the admin API on.
2. Capacity: the 200s per second at 32 connections back to back.
3. Poisson load at ``--load`` x capacity for ``--duration`` s; at ``--update-at`` s one
   ``POST /v1/catalog`` adds ``--changes`` new items and removes as many. Its answer is the
   new version being served (the next batches search it); a probe request right after
   checks that the answer names it and holds no removed item. The update's graphs are
   captured before its answer (each capture's time is read from the server's log).
4. Windows by each request's scheduled start: before the update, during it (from the POST
   until one second after its answer), and after: requests, statuses (lost = no answer),
   P50 / P99 / max latency of the 200s.

    python benchmarks/catalog_updates.py --output benchmarks/results/catalog-updates.json  # GPU
    python benchmarks/catalog_updates.py --tiny --output /tmp/catalog-updates.json        # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from http_serving import SPREAD, build_engine, start_child_server  # noqa: E402
from timing import run_environment  # noqa: E402

from xgr.bench import http_load  # noqa: E402
from xgr.bench.serve import LATENCY_BUDGET_MS, history_sampler  # noqa: E402

TOKEN = "benchmark-admin-token-0123456789"
CAPACITY_CONNECTIONS = 32
CAPTURE_LINE = re.compile(
    r"([0-9.]+) xgr\.engine\.graph_cache captured CUDA graph .* in ([0-9.]+) ms "
    r"\(warm-up run ([0-9.]+) ms\)"
)
TIMELINE_S = 0.5  # P99 of the requests started in each interval this long
SETTLE_S = 1.0  # after the update's answer, still counted as during it


def server_role(args) -> None:
    """Child process: the server, its admin API on; its graph captures logged with their
    wall-clock times."""
    import logging

    from xgr.server.app import create_app
    from xgr.server.config import ServerConfig
    from xgr.server.http import run_server

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(created).3f %(name)s %(message)s"))
    graph_log = logging.getLogger("xgr.engine.graph_cache")
    graph_log.addHandler(handler)
    graph_log.setLevel(logging.INFO)
    engine = build_engine(args)
    config = ServerConfig(
        max_batch_size=args.max_batch_size, default_beam_width=64, admin_token=TOKEN
    )
    run_server(create_app(engine, config), "127.0.0.1", args.port)


def start_server(args, log: Path) -> tuple[subprocess.Popen, int]:
    return start_child_server(__file__, child_args(args), log, timeout_s=900)


def child_args(args) -> list[str]:
    out = ["--shape", args.shape, "--length", str(args.length), "--beam", str(args.beam),
           "--items", str(args.items), "--max-batch-size", str(args.max_batch_size)]  # fmt: skip
    return out + (["--tiny"] if args.tiny else [])


def call(port: int, method: str, path: str, body: dict | None = None) -> dict:
    """One JSON request (the admin token sent); its parsed answer."""
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", data=data, method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=600) as answer:
        return json.loads(answer.read())


def the_update(args) -> tuple[dict, list[str]]:
    """``--changes`` new items with random codes and as many existing ones removed."""
    rng = np.random.default_rng(1)
    removed = [str(i) for i in rng.choice(args.items, args.changes, replace=False)]
    codes = rng.integers(0, 256, (args.changes, 3))
    add = {f"new-{k}": [f"<a_{a}>", f"<b_{b}>", f"<c_{c}>"] for k, (a, b, c) in enumerate(codes)}
    return {"add": add, "remove": removed}, removed


def kept_bodies(args, removed: list[str], count: int = 512) -> list[dict]:
    """Requests of about L tokens whose histories hold only items the update keeps (a
    history naming an item no longer in the catalog is refused)."""
    gone = set(removed)
    kept = [i for i in map(str, range(args.items)) if i not in gone]
    sample = history_sampler(kept, args.length // 3, 0, SPREAD)
    return [{"history": sample(), "beam_width": args.beam, "num_results": 10} for _ in range(count)]


def window(outcomes, start: float, stop: float) -> dict:
    chosen = [o for o in outcomes if start <= o.start < stop]
    stats = http_load.summary(chosen, max(stop - start, 1e-9))
    ok = [o.latency * 1e3 for o in chosen if o.status == 200]
    return {"from_s": start, "to_s": stop, **stats, "max_ms": max(ok) if ok else None}


async def under_load(
    port: int, args, rate: float, requests: list[bytes], update: dict, removed: list[str]
) -> dict:
    probe_body = json.loads(requests[0].split(b"\r\n\r\n", 1)[1])
    pool = http_load.Pool("127.0.0.1", port, timeout=30.0)
    marks = {}

    async def update_later():
        await asyncio.sleep(args.update_at)
        marks["post"], marks["post_wall"] = time.perf_counter(), time.time()
        marks["answer"] = await asyncio.to_thread(call, port, "POST", "/v1/catalog", update)
        marks["served"], marks["served_wall"] = time.perf_counter(), time.time()
        probe = await asyncio.to_thread(call, port, "POST", "/v1/recommend", probe_body)
        marks["probe"] = probe

    origin = time.perf_counter()
    task = asyncio.ensure_future(update_later())
    outcomes = await http_load.open_loop(pool, requests, rate, args.duration, seed=3)
    await task
    pool.close()
    post, served = marks["post"] - origin, marks["served"] - origin
    probe = marks["probe"]
    return {
        "post_wall": marks["post_wall"],
        "served_wall": marks["served_wall"],
        "rate": rate,
        "update": {
            "added": args.changes,
            "removed": args.changes,
            "posted_at_s": post,
            "until_new_version_serves_s": served - post,
            "new_version": marks["answer"]["catalog_version"],
            "items_after": marks["answer"]["num_items"],
            "probe_catalog_version": probe["catalog_version"],
            "probe_holds_removed_items": bool(
                {i["item_id"] for i in probe["items"]} & set(removed)
            ),
        },
        "all": window(outcomes, 0.0, args.duration),
        "before": window(outcomes, 0.0, post),
        "during": window(outcomes, post, served + SETTLE_S),
        "after": window(outcomes, served + SETTLE_S, args.duration),
        "lost_reasons": pool.lost,
        "timeline": [
            {
                "from_s": t,
                "requests": len(chosen),
                "p99_ms": http_load.summary(chosen, TIMELINE_S)["p99_ms"],
            }
            for t in np.arange(0.0, args.duration, TIMELINE_S).round(3).tolist()
            if (chosen := [o for o in outcomes if t <= o.start < t + TIMELINE_S])
        ],  # fmt: skip
    }


def logged_captures(log: Path) -> list[dict]:
    """The server's graph captures from its log: wall-clock time (s), duration and warm-up
    run (ms)."""
    found = []
    for line in log.read_text().splitlines():
        match = CAPTURE_LINE.match(line)
        if match:
            at, ms, warm = map(float, match.groups())
            found.append({"at": at, "ms": ms, "warm_up_ms": warm})
    return found


async def capacity(port: int, requests: list[bytes], seconds: float) -> float:
    pool = http_load.Pool("127.0.0.1", port, timeout=30.0)
    outcomes = await http_load.closed_loop(pool, requests, CAPACITY_CONNECTIONS, seconds)
    pool.close()
    return http_load.summary(outcomes, seconds)["ok_per_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    parser.add_argument("--role", choices=["main", "server"], default="main")
    parser.add_argument("--port", type=int)
    parser.add_argument("--shape", default="qwen2.5-0.5b")
    parser.add_argument("--length", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=256)
    parser.add_argument("--items", type=int, default=1_000_000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--load", type=float, default=0.7, help="fraction of capacity")
    parser.add_argument("--duration", type=float, default=40.0)
    parser.add_argument("--update-at", type=float, default=15.0)
    parser.add_argument("--changes", type=int, default=10_000)
    args = parser.parse_args()
    if args.tiny:
        args.length, args.beam, args.items = 60, 16, min(args.items, 20_000)
        args.changes = min(args.changes, 1000)
    if args.role == "server":
        return server_role(args)
    if args.output is None:
        parser.error("--output is needed")
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    log = Path(args.output).with_suffix(".server.log")
    process, port = start_server(args, log)
    try:
        update, removed = the_update(args)
        requests = http_load.request_bytes("127.0.0.1", port, kept_bodies(args, removed))
        full = asyncio.run(capacity(port, requests, 4.0 if args.tiny else 8.0))
        print(f"capacity {full:.1f} answers/s at {CAPACITY_CONNECTIONS} connections", flush=True)
        result = asyncio.run(under_load(port, args, args.load * full, requests, update, removed))
    finally:
        process.terminate()
        process.wait(30)
    # Graphs captured after the POST: ahead of the swap (before its answer), and by the new
    # version's batches after it.
    posted, served = result.pop("post_wall"), result.pop("served_wall")
    captures = [c for c in logged_captures(log) if c["at"] >= posted]
    for c in captures:
        c["at_s"] = round(c.pop("at") - posted, 3)
    ahead = [c for c in captures if c["at_s"] <= served - posted]
    result["update"]["graphs_captured_ahead"] = len(ahead)
    result["update"]["graphs_captured_after_served"] = len(captures) - len(ahead)
    result["update"]["last_capture_after_s"] = max((c["at_s"] for c in captures), default=None)
    result["update"]["captures"] = captures
    report = {
        "benchmark": "a catalog update under load over HTTP",
        **run_environment("cpu" if args.tiny else "cuda"),
        "shape": args.shape,
        "prompt_len": args.length,
        "beam_width": args.beam,
        "items": args.items,
        "max_batch_size": args.max_batch_size,
        "capacity_per_s": full,
        "load": args.load,
        "latency_budget_ms": LATENCY_BUDGET_MS,
        **result,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=1) + "\n")
    update = result["update"]
    print(
        f"update +{update['added']} -{update['removed']}: new version {update['new_version']} "
        f"serves {update['until_new_version_serves_s']:.2f} s after the POST; probe saw "
        f"version {update['probe_catalog_version']}, removed items in it: "
        f"{update['probe_holds_removed_items']}; graphs captured ahead "
        f"{update['graphs_captured_ahead']}, after {update['graphs_captured_after_served']}"
    )
    if update["captures"]:
        times = [c["ms"] for c in update["captures"]]
        print(f"captures: {min(times):.1f}-{max(times):.1f} ms each, {sum(times):.0f} ms in all")
    print(f"{'window':<8}{'requests':>9}{'ok':>7}{'P50 ms':>9}{'P99 ms':>9}{'max ms':>9}  statuses")
    for name in ("before", "during", "after", "all"):
        w = result[name]
        fmt = lambda v: f"{v:9.1f}" if v is not None else f"{'-':>9}"  # noqa: E731
        print(
            f"{name:<8}{w['requests']:>9}{w['ok']:>7}{fmt(w['p50_ms'])}{fmt(w['p99_ms'])}"
            f"{fmt(w['max_ms'])}  {w['statuses']}"
        )


if __name__ == "__main__":
    main()
