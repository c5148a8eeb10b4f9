"""Ray Serve's overhead: the same open-loop load through one xgr replica on Ray Serve and
through plain ``xgr serve``, side by side in one run: the highest rate within P99 <= 200 ms
of each, and their ratio.

1. Plain: ``xgr serve``'s app and HTTP stack over the benchmark's engine in a child
   process (``http_serving.py``'s server).
2. Ray: a local Ray instance in a child process, one replica of the same engine deployed
   by ``xgr.server.ray_serve.application``, behind Serve's proxy.
3. Each: ``http_serving.py``'s sweep (Poisson rates rising x1.5 until P99 > 200 ms or > 1%
   errors, then two bisections) from this process.

    python benchmarks/ray_overhead.py --tiny --output benchmarks/results/ray-overhead.json  # CPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

import http_serving  # noqa: E402
from http_serving import build_engine, child_args, http_levels, start_child_server, sweep  # noqa: E402


class BenchmarkSource:
    """The replica's model: the benchmark's engine (``XgrReplica`` calls ``load``)."""

    def __init__(self, args) -> None:
        self.args = args

    def load(self, cuda_streams: int = 1):
        return build_engine(self.args)


def ray_role(args) -> None:
    """Child process: one replica on a local Ray instance, Serve's proxy on ``--port``."""
    import ray
    from ray import serve

    from xgr.server.config import ServerConfig
    from xgr.server.ray_serve import PROXY_CALLBACK, ReplicaOptions, application

    os.environ.setdefault(*PROXY_CALLBACK)
    path = os.pathsep.join([str(HERE), str(HERE.parent / "src")])
    ray.init(
        num_cpus=args.ray_cpus, include_dashboard=False, log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": path, "OMP_NUM_THREADS": "1"}},
    )  # fmt: skip
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    config = ServerConfig(max_batch_size=args.max_batch_size, default_beam_width=64)
    app = application(BenchmarkSource(args), config, ReplicaOptions(1), 0, args.length)
    serve.run(app, name="xgr", route_prefix="/")
    while True:
        time.sleep(3600)


def measured(label: str, args, role_args: list[str], log: Path) -> dict:
    print(f"{label} sweep", flush=True)
    process, port = start_child_server(__file__, role_args + child_args(args), log)
    try:

        def measure(rate: float) -> dict:
            (point,) = asyncio.run(http_levels(port, args, [("rate", rate)]))
            return point

        return sweep(measure, args.start_rate)
    finally:
        process.terminate()
        process.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path)
    parser.add_argument("--tiny", action="store_true", help="a tiny model on the CPU")
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--length", type=int, default=60, help="prompt tokens (+-20%%)")
    parser.add_argument("--beam", type=int, default=16)
    parser.add_argument("--items", type=int, default=2000)
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per level")
    parser.add_argument("--start-rate", type=float, default=40.0)
    parser.add_argument("--ray-cpus", type=int, default=2)
    parser.add_argument("--role", choices=["main", "server"], default="main")
    parser.add_argument("--backend", choices=["plain", "ray"], default="plain")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    args.max_queue = 4096  # http_serving's server reads it
    if args.role == "server":
        return ray_role(args) if args.backend == "ray" else http_serving.server_role(args)
    if args.output is None:
        parser.error("--output is required")
    from timing import run_environment

    logs = Path(tempfile.mkdtemp(prefix="xgr-ray-"))
    plain = measured("plain xgr serve", args, [], logs / "plain.log")
    on_ray = measured("Ray Serve, one replica", args, ["--backend", "ray"], logs / "ray.log")
    ratio = None
    if plain["max_rate_within_budget"] and on_ray["max_rate_within_budget"]:
        ratio = on_ray["max_rate_within_budget"] / plain["max_rate_within_budget"]
    report = {
        "benchmark": "Ray Serve (one replica) against plain xgr serve: rate within P99 <= 200 ms",
        **run_environment("cpu" if args.tiny else "cuda"),
        "shape": args.shape, "prompt_len": args.length, "beam_width": args.beam,
        "items": args.items, "max_batch_size": args.max_batch_size,
        "duration_s_per_level": args.duration, "ray_cpus": args.ray_cpus,
        "plain": plain, "ray": on_ray, "ray_over_plain": ratio,
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{'server':<28}{'rate within budget':>20}{'answers/s':>12}")
    for name, result in (("plain xgr serve", plain), ("Ray Serve, one replica", on_ray)):
        print(f"{name:<28}{result['max_rate_within_budget'] or 0:>20.1f}"
              f"{result['throughput_within_budget'] or 0:>12.1f}")  # fmt: skip
    print(f"ratio {ratio}")


if __name__ == "__main__":
    main()
