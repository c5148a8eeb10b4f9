"""Serving throughput under a P99 <= 200 ms budget, batching against one at a time.

xgr's scheduler with batching (1..N CUDA streams) against the same engine one request at a
time, on random-weight models of real shapes.

For each configuration (model shape, prompt length drawn within +-20% of L, beam width =
top_k) and each scheduler setting, open-loop Poisson load runs at rising rates (x1.5 per step)
until P99 exceeds 200 ms or more than 1% of requests fail, then two geometric bisections
between the last rate that held and the first that broke; the highest rate that kept the
budget is the setting's throughput. One request at a time starts from half the rate its
single-request latency allows; the batching settings start from the rate it reached, and
step down when that already breaks the budget. The load
runs in-process (``xgr.bench``: the server's scheduler without HTTP). HF transformers cannot
answer one such request within 200 ms (``e2e_latency.py`` measures it at seconds), so its
throughput within the budget is 0; its single-request latency is taken from that benchmark
(``t5_latency.py`` for the T5 configurations, ``--configs 3 4``).

    python benchmarks/serving_throughput.py --output benchmarks/results/serving.json
    python benchmarks/serving_throughput.py --tiny --output /tmp/serving.json  # CPU smoke
    python benchmarks/serving_throughput.py --configs 1 --quantization none fp8 --output q.json

With several ``--quantization`` values each decoder-only configuration runs once per value
(``xgr.models.quantize``; "none": the model dtype), one after the other in the same process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import (  # noqa: E402
    SHAPES,
    TINY,
    hf_model,
    random_catalog,
    request_flops,
    sid_token_map,
    xgr_model,
)
from t5_latency import SHAPES as T5_SHAPES  # noqa: E402
from t5_latency import TINY as T5_TINY  # noqa: E402
from t5_latency import write_t5  # noqa: E402
from timing import run_environment  # noqa: E402

from xgr import Engine  # noqa: E402
from xgr.bench.serve import (  # noqa: E402
    LATENCY_BUDGET_MS,
    LoadPlan,
    bench_in_process,
    history_sampler,
    within_budget,
)
from xgr.models import load_model  # noqa: E402
from xgr.models.quantize import QUANTIZATIONS, quantize_fp8  # noqa: E402

# (shape, prompt length, beam width, largest batch): the decoder-only configurations first.
# The batch limits sit above what the 200 ms budget lets the deadline rule form (a batch of
# 8 x 5000 tokens alone takes about the budget), and bound the CUDA graphs warmed up.
# For Qwen2.5-0.5B at L~1000 a limit of 16 held P99 <= 200 ms at a higher rate than 32
# (docs/performance.md): a batch of 32 takes ~110 ms, and a request arriving as one starts
# waits for it, then for its own.
CONFIGS = [
    ("qwen2.5-0.5b", 1000, 256, 16),
    ("qwen3-1.7b", 5000, 256, 8),
    ("qwen2.5-0.5b", 3000, 512, 16),
    ("t5-onerec-like", 1024, 512, 16),  # encoder-decoders (t5_latency.py's shapes)
    ("t5-tiger", 256, 256, 32),
]
TINY_CONFIGS = [("tiny", 60, 16, 8), ("tiny-t5", 60, 16, 8)]
SPREAD = 0.2  # prompt lengths drawn within +-20% of L
RATE_STEP = 1.5
MAX_DOWN = 3
MAX_STEPS = 12
REFINE_STEPS = 2


def build_model(shape: str, tiny: bool, device: str, quantization: str = "none"):
    """The xgr model of a configuration's shape: decoder-only from e2e_latency's shapes
    (quantized unless ``quantization`` is "none"), T5 through a saved random HF folder and
    xgr's loader (t5_latency's shapes)."""
    if shape in T5_SHAPES or shape == "tiny-t5":
        dtype = torch.float32 if tiny else torch.bfloat16
        with tempfile.TemporaryDirectory() as tmp:
            write_t5(T5_TINY if tiny else T5_SHAPES[shape], Path(tmp), dtype)
            return load_model(tmp, device, dtype)
    model = xgr_model(hf_model(TINY if tiny else SHAPES[shape], device))
    if quantization != "none":
        model.fuse_projections()
        quantize_fp8(model.to(torch.bfloat16), quantization)
    return model


def rate_sweep(held, start_rate: float) -> None:
    """Open-loop rates from ``start_rate``: up x1.5 while the budget holds, or, when the
    first rate already breaks it, down /1.5 (at most MAX_DOWN times) until one holds; then
    REFINE_STEPS geometric bisections between the highest rate that held and the lowest
    above it that broke (x1.5 steps alone leave the limit anywhere in a 50% interval).

    ``held(rate)`` runs one level (recording it as it likes) and says whether it kept the
    budget.
    """
    best_rate = broke_rate = None

    def run(rate: float) -> bool:
        nonlocal best_rate, broke_rate
        kept = held(rate)
        if kept and (best_rate is None or rate > best_rate):
            best_rate = rate
        if not kept and (broke_rate is None or rate < broke_rate):
            broke_rate = rate
        return kept

    rate = start_rate
    for _ in range(MAX_STEPS):
        kept = run(rate)
        going_down = rate < start_rate
        if best_rate is None and rate > start_rate / RATE_STEP**MAX_DOWN:
            rate /= RATE_STEP  # nothing kept the budget yet: look lower
        elif kept and not going_down:
            rate *= RATE_STEP
        else:
            break  # the budget broke going up, or a lower rate kept it going down
    for _ in range(REFINE_STEPS):
        if best_rate is None or broke_rate is None or broke_rate <= best_rate:
            break
        run((best_rate * broke_rate) ** 0.5)


def sweep(engine, plan_for, start_rate: float, max_batch_size: int, max_batch_ms) -> dict:
    """``rate_sweep`` of in-process load against ``engine``.

    Returns:
        the points run and the highest rate that kept the budget (None: none did).
    """
    points, kept_points = [], []

    def held(rate: float) -> bool:
        (point,) = asyncio.run(
            bench_in_process(engine, plan_for(rate), max_batch_size, max_batch_ms, progress=False)
        )
        points.append(point)
        print(
            f"    rate {rate:7.1f}/s -> {point.throughput:7.1f}/s, P99 "
            f"{point.p99_ms if point.p99_ms is None else round(point.p99_ms, 1)} ms, "
            f"{point.requests - point.ok} failed",
            flush=True,
        )
        kept = within_budget(point)
        if kept:
            kept_points.append(point)
        return kept

    rate_sweep(held, start_rate)
    best = max(kept_points, key=lambda p: p.load, default=None)
    return {
        "points": [dataclasses.asdict(p) for p in points],
        "max_rate_within_budget": best.load if best else None,
        "throughput_within_budget": best.throughput if best else None,
    }


def _req_per_s(throughput: float | None) -> str:
    return "none within the budget" if throughput is None else f"{throughput:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per rate")
    parser.add_argument("--streams", type=int, nargs="*", default=[1, 2, 4])
    parser.add_argument("--max-batch-size", type=int, help="override each config's limit")
    parser.add_argument("--configs", type=int, nargs="*", help="indexes into CONFIGS")
    parser.add_argument(
        "--max-batch-ms",
        type=float,
        default=50.0,
        help="also run one stream with batches capped at this predicted time (0: skip)",
    )
    parser.add_argument(
        "--quantization",
        nargs="+",
        choices=("none", *QUANTIZATIONS),
        default=["none"],
        help="run each decoder-only configuration with each of these (T5: none only)",
    )
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    configs = TINY_CONFIGS if args.tiny else [CONFIGS[i] for i in (args.configs or range(3))]
    streams = [1] if args.tiny else args.streams
    report = {
        "benchmark": "highest open-loop rate with P99 <= 200 ms and <= 1% errors",
        **run_environment(device),
        "duration_s_per_rate": args.duration,
        "results": [],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    catalog = random_catalog(5000 if args.tiny else 1_000_000, 3)
    models = {}
    runs = [
        (config, quantization)
        for config in configs
        for quantization in args.quantization
        if quantization == "none" or config[0] in SHAPES or config[0] == "tiny"
    ]
    for (shape, length, beam, max_batch), quantization in runs:
        max_batch = args.max_batch_size or max_batch
        if (shape, quantization) not in models:
            models.clear()
            gc.collect()
            models[shape, quantization] = build_model(shape, args.tiny, device, quantization)
        model = models[shape, quantization]
        sid_map = sid_token_map(model.config.vocab_size, catalog.num_levels)
        print(f"{shape} L~{length} B={beam} quantization {quantization}", flush=True)
        row = {"shape": shape, "prompt_len": length, "beam_width": beam,
               "quantization": quantization, "settings": {}}  # fmt: skip
        figures = []
        # One request at a time first: its rate is where the batching sweeps start.
        settings = [("no batching", 1, 1, None)] + [
            (f"batching, {s} stream{'s' if s > 1 else ''}", max_batch, s, None) for s in streams
        ]
        if args.max_batch_ms:
            label = f"batching, 1 stream, batches <= {args.max_batch_ms:g} ms"
            settings.append((label, max_batch, 1, args.max_batch_ms))
        start_rate = no_batching_best = None
        for label, batch_size, lanes, batch_ms in settings:
            engine = Engine(model, catalog, sid_map, name=shape, cuda_streams=lanes)
            began = time.perf_counter()
            captured = engine.warm_up(length, beam, beam, batch_size, SPREAD)
            warm_s = time.perf_counter() - began
            print(f"  {label}: warm-up captured {captured} graphs in {warm_s:.1f} s", flush=True)
            histories = history_sampler(catalog.item_ids, length // catalog.num_levels, 0, SPREAD)

            def plan_for(rate, histories=histories, beam=beam):
                return LoadPlan(histories, beam, 10, None, [rate], [], args.duration)

            if start_rate is None:  # warm up and time one request alone
                for _ in range(3):
                    began = time.perf_counter()
                    engine.recommend([engine.history_prompt(histories())], beam, beam)
                alone_s = time.perf_counter() - began
                row["single_request_ms"] = alone_s * 1e3
                # at least a few arrivals in the first level (a Poisson window can be empty)
                start_rate = max(3 / args.duration, 0.5 / alone_s)
            # Batching starts where one request at a time topped out: the rates below it
            # cost time and tell nothing new (the sweep steps down if it breaks there).
            first = start_rate if label == "no batching" else no_batching_best or start_rate
            result = sweep(engine, plan_for, first, batch_size, batch_ms)
            if label == "no batching":
                no_batching_best = result["max_rate_within_budget"]
            result.update(
                max_batch_size=batch_size,
                max_batch_ms=batch_ms,
                warm_up_graphs=captured,
                warm_up_s=warm_s,
            )
            row["settings"][label] = result
            encdec = model.is_encoder_decoder  # request_flops counts decoder-only models
            flops = 0 if encdec else request_flops(model.config, length, beam, catalog.num_levels)
            if result["throughput_within_budget"] and device == "cuda" and flops:
                rate = result["throughput_within_budget"] * flops
                result["matmul_rate_needed_tflops"] = rate / 1e12
            figures += [dataclasses.replace(p, mode=label) for p in _points(result)]
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
        report["results"].append(row)
        suffix = "" if quantization == "none" else f"-{quantization}"
        plot_path = args.output.with_name(
            f"{args.output.stem}-{shape}-L{length}-B{beam}{suffix}.png"
        )
        title = f"{shape}, prompt ~{length}, beam {beam}" + (f", {quantization}" if suffix else "")
        _plot(figures, plot_path, title)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
    print("\nthroughput at the highest rate with P99 <= 200 ms (requests/s):")
    for row in report["results"]:
        best = ", ".join(
            f"{setting} {_req_per_s(figures['throughput_within_budget'])}"
            for setting, figures in row["settings"].items()
        )
        print(f"  {row['shape']} L~{row['prompt_len']} B={row['beam_width']} "
              f"{row['quantization']}: {best}")  # fmt: skip
    args.output.write_text(json.dumps(report, indent=1) + "\n")


def _points(result):
    from xgr.bench.load import LoadPoint

    return [LoadPoint(**p) for p in result["points"]]


def _plot(points, path, title) -> None:
    """One P99 line per scheduler setting (``mode`` holds the setting's label here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label in dict.fromkeys(p.mode for p in points):
        series = sorted((p for p in points if p.mode == label and p.p99_ms), key=lambda p: p.load)
        ax.plot([p.throughput for p in series], [p.p99_ms for p in series], "o-", label=label)
    ax.axhline(LATENCY_BUDGET_MS, color="grey", linestyle=":", label="200 ms budget")
    ax.set_xlabel("throughput (requests/s)")
    ax.set_ylabel("P99 latency (ms)")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
