"""Where one request's GPU time goes: a kernel profile of prefill and of the decode levels.

Runs one request (Qwen3-1.7B shape, random bf16 weights, 1M-item catalog of 3 x 256 codes) on
the eager path, so the profiler sees every kernel, and sums device time per kernel family
(GEMM, attention, xgr's fused elementwise kernels, beam selection, other). It also times the
same request through the CUDA-graph path and profiles it once there: its kernels, and the
span from the first kernel's start to the last one's end (kernels plus the gaps between).

    python benchmarks/profile_request.py --output profile.json [--prompt-len 1000 --beam 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import SHAPES, TINY, hf_model, random_catalog, sid_token_map, xgr_model  # noqa: E402

from xgr import Engine  # noqa: E402
from xgr.engine.inputs import prepare_inputs  # noqa: E402
from xgr.engine.search import search_levels  # noqa: E402
from xgr.runner import LevelBatch  # noqa: E402

FAMILIES = (  # first match wins; matched against lower-case kernel names
    ("decode attention (xgr Triton)", ("_beam_decode_attention",)),
    ("prefill attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    (
        "fused elementwise (xgr Triton)",
        ("_rms_norm", "_rope", "_silu_mul", "_gated_mul", "_qkv_heads"),
    ),
    ("beam selection", ("_score_candidates", "_gather_selected", "topk", "sort", "radix")),
    ("GEMM", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "matmul", "linear")),
    ("reductions (log-sum-exp)", ("reduce", "logsumexp")),
    ("copies and indexing", ("copy", "memcpy", "index", "gather", "scatter", "cat")),
)


def family(name: str) -> str:
    low = name.lower()
    for label, keys in FAMILIES:
        if any(k in low for k in keys):
            return label
    return "other elementwise"


def kernel_table(prof, cuda: bool) -> tuple[dict[str, float], list[tuple[str, float, int]], float]:
    """Device ms per family, the top kernels (name, ms, calls) and the span of a profile
    (ms from the first kernel's start to the last one's end: kernels plus the gaps between).

    On the CPU (the --tiny smoke run) top-level CPU ops stand in for kernels.
    """
    per_kernel: dict[str, list[float]] = defaultdict(list)
    starts, ends = [], []
    for event in prof.events():
        if cuda and event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name].append(event.device_time_total / 1e3)
        elif not cuda and event.cpu_parent is None:
            per_kernel[event.name].append(event.cpu_time_total / 1e3)
        else:
            continue
        starts.append(event.time_range.start)
        ends.append(event.time_range.end)
    families: dict[str, float] = defaultdict(float)
    for name, times in per_kernel.items():
        families[family(name)] += sum(times)
    top = sorted(((n, sum(t), len(t)) for n, t in per_kernel.items()), key=lambda r: -r[1])
    span_ms = (max(ends) - min(starts)) / 1e3 if starts else 0.0
    return dict(families), top[:12], span_ms


def profile_phases(phases: dict[str, Callable[[], object]], cuda: bool) -> tuple[dict, list[str]]:
    """Run each phase once under the profiler, in order (a phase may use an earlier one's
    result through its closure).

    Returns:
        per phase ``{"families_ms", "top_kernels", "kernel_ms", "span_ms"}``, and the lines
        printing them (families largest first, then the top kernels).
    """
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activity = [ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]
    report, lines = {}, []
    for phase, run in phases.items():
        sync()
        with profile(activities=activity) as prof:
            run()
            sync()
        families, top, span = kernel_table(prof, cuda)
        report[phase] = {"families_ms": families, "top_kernels": top,
                         "kernel_ms": sum(families.values()), "span_ms": span}  # fmt: skip
        lines.append(
            f"\n{phase}: {sum(families.values()):.2f} ms of kernels in a {span:.2f} ms span"
        )
        for label, ms in sorted(families.items(), key=lambda kv: -kv[1]):
            lines.append(f"  {label:<34}{ms:8.2f} ms")
        lines.append("  top kernels:")
        for name, ms, calls in top[:8]:
            lines.append(f"    {ms:7.2f} ms {calls:5d}x  {name[:90]}")
    return report, lines


def host_split(engine: Engine, prompts: list[list[int]], beam: int, cuda: bool) -> dict:
    """Median wall ms of a served request's parts: the host work until its device work is
    queued (``recommend_async``: checks, packing, graph replays), the wait for the device,
    and the host work after it (``result``: item lookup); with ``tokenize`` and
    ``prepare_inputs`` alone, and the host functions of one launch by own time (cProfile)."""
    import cProfile
    import pstats

    parts = defaultdict(list)
    for _ in range(9):
        start = time.perf_counter()
        [engine.tokenize(p) for p in prompts]
        tokenized = time.perf_counter()
        prepare_inputs(prompts, engine.device)
        prepared = time.perf_counter()
        if cuda:
            torch.cuda.synchronize()
        start_launch = time.perf_counter()
        pending = engine.recommend_async(prompts, beam_width=beam, top_k=beam)
        launched = time.perf_counter()
        if pending._pending.events is not None:
            pending._pending.events[-1].synchronize()
        waited = time.perf_counter()
        pending.result()
        parts["tokenize"].append((tokenized - start) * 1e3)
        parts["prepare_inputs"].append((prepared - tokenized) * 1e3)
        parts["launch (recommend_async)"].append((launched - start_launch) * 1e3)
        parts["device wait"].append((waited - launched) * 1e3)
        parts["collect (result)"].append((time.perf_counter() - waited) * 1e3)
    split = {name: statistics.median(times[2:]) for name, times in parts.items()}
    profiler = cProfile.Profile()
    profiler.enable()
    pending = engine.recommend_async(prompts, beam_width=beam, top_k=beam)
    profiler.disable()
    pending.result()
    stats = pstats.Stats(profiler).sort_stats("tottime")
    split["launch_top_functions"] = [
        (f"{func[0].rsplit('/', 1)[-1]}:{func[1]} {func[2]}", row[2] * 1e3)
        for func, row in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:12]
    ]
    for name, ms in split.items():
        if name != "launch_top_functions":
            print(f"host: {name:<28}{ms:8.3f} ms")
    for name, ms in split["launch_top_functions"]:
        print(f"  launch, own time: {ms:7.3f} ms  {name}")
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    parser.add_argument("--prompt-len", type=int, default=1000)
    parser.add_argument("--beam", type=int, default=256)
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    args = parser.parse_args()
    cuda = not args.tiny
    model = xgr_model(
        hf_model(TINY if args.tiny else SHAPES[args.shape], "cuda" if cuda else "cpu")
    )
    catalog = random_catalog(5000 if args.tiny else 1_000_000, 3)
    engine = Engine(model, catalog, sid_token_map(model.config.vocab_size, 3), cuda_graphs=False)
    graphed = Engine(model, catalog, sid_token_map(model.config.vocab_size, 3))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size - 3 * 256
    prompts = [rng.integers(0, vocab, args.prompt_len).tolist() for _ in range(args.requests)]
    beam, spec = args.beam, engine.decode_spec

    def timed(eng) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            eng.recommend(prompts, beam_width=beam, top_k=beam)
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times[2:])

    shape = "tiny" if args.tiny else args.shape
    report = {"shape": shape, "prompt_len": args.prompt_len, "beam_width": beam}
    report.update(requests=args.requests, eager_ms=timed(engine), graph_ms=timed(graphed))
    report["host_ms"] = host_split(graphed, prompts, beam, cuda)
    with torch.inference_mode():
        inputs = prepare_inputs(prompts, engine.device)
        from xgr.engine.generate import allocate_shared_kv

        shared = allocate_shared_kv(model, inputs)
        prefilled = []  # the prefill's output, for the decode phase
        batch = LevelBatch(shared, inputs.prompt_lens, inputs.cu_seqlens_host)
        together = engine.runner.first_levels_together(len(prompts), beam)
        code_kv = engine.runner.allocate_code_kv(len(prompts)) if together else None
        phases = {
            "prefill": lambda: prefilled.append(
                engine.runner.prefill(inputs.prefill_batch(shared, code_kv))
            ),
            "decode levels": lambda: search_levels(spec, batch, prefilled[0], beam, beam, together),
            # The whole request as served (on CUDA through the graphs ``timed`` captured):
            # its kernels, and from the span the time between them.
            f"request ({'CUDA graphs' if cuda else 'default path'})": lambda: graphed.recommend(
                prompts, beam_width=beam, top_k=beam
            ),
        }
        profiled, phase_lines = profile_phases(phases, cuda)
    report.update(profiled)
    lines = [
        f"{shape} L={args.prompt_len} B={beam} R={args.requests}: eager "
        f"{report['eager_ms']:.1f} ms, {'CUDA graphs' if cuda else 'default path'} "
        f"{report['graph_ms']:.1f} ms",
        *phase_lines,
    ]
    args.output.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
