"""bf16 on the GPU against float32: the same top-10 items for how many requests? GPU.

The question is whether bf16 results agree with the float32 reference on the top-10 item
set for at least 99% of a fixed set of requests. Random-weight models make that test moot:
their scores are nearly flat, so top-10 lists are decided by differences below bf16's
precision. This benchmark uses the trained demo models instead (``xgr eval --demo``'s
MovieLens-100K models, decoder-only and T5) and every demo user's leave-one-out history as
the request set. For each model it runs the same requests through:

- the references: eager, torch attention (the CPU path's kernels, on the GPU), in float32
  and in bfloat16;
- the float32 reference with every weight rounded to bfloat16 first (float32 arithmetic):
  how far the weights' rounding alone moves the results, whatever the kernels do;
- the served path: bfloat16, CUDA graphs, Triton attention;

and reports, against each reference, the fraction of requests whose top-10 item sets are
equal and the mean overlap, and each path's Recall@10 / NDCG@10 on the held-out items
(history items excluded, as in ``xgr eval``). Where the sets differ it also reports how far
the differing items' reference scores lie from the reference's 10th score, and the fraction
equal up to ties within 0.01 / 0.03 / 0.1 nats (a near-tie that rounding decides). Against
float32 the figure mixes bf16's own rounding (weights, activations) with the kernels';
against the bf16 reference it isolates what the served path's kernels and graphs change.

    python benchmarks/bf16_agreement.py --output bf16.json            # builds the demos if absent
    python benchmarks/bf16_agreement.py --output bf16.json --device cpu --users 50   # smoke

With ``--quantization fp8 ...`` the served path also runs with each FP8 quantization
(``xgr.models.quantize``, decoder-only models), reported against the bf16 served path and
the float32 reference in the same way.

    python benchmarks/bf16_agreement.py --output q.json --arch qwen2 --quantization fp8

On the CPU the served path is the reference path (no graphs, no Triton), so its agreement
with the bf16 reference is 1 by construction; there the run checks the script and gives the
float32-vs-bf16 figure alone.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import run_environment  # noqa: E402

from xgr import Engine  # noqa: E402
from xgr.demo import DemoConfig, build_demo, load_movielens  # noqa: E402
from xgr.demo.movielens import leave_one_out  # noqa: E402
from xgr.evaluation.metrics import ndcg_at_k, recall_at_k  # noqa: E402
from xgr.models.quantize import QUANTIZATIONS  # noqa: E402
from xgr.training.evaluate import score_items  # noqa: E402

K = 10


def reference_engine(folder: Path, device: str, dtype: str) -> Engine:
    """The reference path: eager, torch attention (the CPU path's kernels)."""
    engine = Engine.from_pretrained(folder, device=device, dtype=dtype, cuda_graphs=False)
    engine.runner.attention_backend = "torch"
    return engine


# Score gaps (nats of summed log-probability) at which a differing item counts as a near-tie.
TIE_GAPS = (0.01, 0.03, 0.1)


def agreement(got: list[dict], want: list[dict]) -> dict:
    """Requests with equal top-K item sets, mean overlap, and where the sets differ, how far
    the differing items' scores in ``want`` lie from ``want``'s K-th score: a gap below
    bf16's resolution is a near-tie that rounding decides either way."""
    same, overlap, gaps = [], [], []
    for a, b in zip(got, want, strict=True):
        top_a, top_b = list(a)[:K], list(b)[:K]
        same.append(set(top_a) == set(top_b))
        overlap.append(len(set(top_a) & set(top_b)) / K)
        if not same[-1] and len(top_b) == K:
            cut = b[top_b[-1]]
            differing = set(top_a) ^ set(top_b)
            gaps.append(max(abs(b.get(i, float("-inf")) - cut) for i in differing))
    n = len(same)
    return {
        "same_top10_set": sum(same) / n,
        "mean_overlap": sum(overlap) / n,
        "differing_requests": len(gaps),
        # Requests whose sets are equal, or differ only by items within the gap of the cut.
        "same_up_to_ties": {
            str(gap): (sum(same) + sum(g <= gap for g in gaps)) / n for gap in TIE_GAPS
        },
        "largest_gap": max(gaps, default=0.0),
    }


def rounded_weights_engine(folder: Path, device: str) -> Engine:
    """The float32 reference path with its weights rounded to bfloat16 (float32 arithmetic)."""
    engine = reference_engine(folder, device, "float32")
    with torch.no_grad():
        for parameter in engine.model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))
    return engine


def compare(
    folder: Path, histories, targets, beam_width, batch_size, device, quantizations=()
) -> dict:
    """The served bf16 path of one model folder against the float32 and bf16 references,
    and each of ``quantizations`` served against the bf16 served path and float32."""
    runs = {
        "float32 reference": lambda: reference_engine(folder, device, "float32"),
        "float32, weights rounded to bfloat16": lambda: rounded_weights_engine(folder, device),
        "bfloat16 reference": lambda: reference_engine(folder, device, "bfloat16"),
        "bfloat16 served": lambda: Engine.from_pretrained(folder, device=device, dtype="bfloat16"),
    }
    for q in quantizations:
        runs[f"{q} served"] = lambda q=q: Engine.from_pretrained(
            folder, device=device, dtype="bfloat16", quantization=q
        )
    # One engine at a time: each is dropped once its requests are scored.
    scored = {
        name: score_items(make(), histories, beam_width, batch_size) for name, make in runs.items()
    }
    served = scored["bfloat16 served"]
    quantized = {
        q: {
            "vs_bfloat16_served": agreement(scored[f"{q} served"], served),
            "vs_float32": agreement(scored[f"{q} served"], scored["float32 reference"]),
        }
        for q in quantizations
    }
    return {
        **({"quantized": quantized} if quantized else {}),
        "requests": len(served),
        "served_vs_float32": agreement(served, scored["float32 reference"]),
        "served_vs_bfloat16_reference": agreement(served, scored["bfloat16 reference"]),
        "bfloat16_reference_vs_float32": agreement(
            scored["bfloat16 reference"], scored["float32 reference"]
        ),
        "rounded_weights_vs_float32": agreement(
            scored["float32, weights rounded to bfloat16"], scored["float32 reference"]
        ),
        "quality": {
            name: {
                f"recall@{K}": recall_at_k([list(r)[:K] for r in lists], targets, K),
                f"ndcg@{K}": ndcg_at_k([list(r)[:K] for r in lists], targets, K),
            }
            for name, lists in scored.items()
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/xgr/demo"))
    parser.add_argument("--arch", nargs="*", default=["qwen2", "t5"])
    parser.add_argument("--beam-width", type=int, default=64, help="as xgr eval's default")
    parser.add_argument("--users", type=int, help="only the first users (default: all)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--quantization",
        nargs="*",
        default=[],
        choices=list(QUANTIZATIONS),
        help="also serve decoder-only models with these FP8 quantizations",
    )
    args = parser.parse_args()
    cache = args.cache_dir.expanduser()
    split = leave_one_out(load_movielens(cache))
    count = len(split.users) if args.users is None else args.users
    histories, targets = split.histories[:count], split.targets[:count]
    report = {
        "benchmark": "top-10 agreement, bf16 served path vs float32 reference (demo models)",
        **run_environment(args.device),
        "beam_width": args.beam_width,
        "results": {},
    }
    print(f"{'model':<8}{'requests':>9}{'same set vs f32':>17}{'vs bf16 ref':>13}"
          f"{'up to 0.03 ties':>17}{'rounded weights':>17}{'R@10 f32':>10}"
          f"{'R@10 served':>13}", flush=True)  # fmt: skip
    for arch in args.arch:
        folder = build_demo(cache, DemoConfig.for_arch(arch))
        quantizations = [] if arch == "t5" else args.quantization
        row = compare(folder, histories, targets, args.beam_width, args.batch_size, args.device,
                      quantizations)  # fmt: skip
        report["results"][arch] = row
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1) + "\n")
        quality = row["quality"]
        print(
            f"{arch:<8}{row['requests']:>9}"
            f"{row['served_vs_float32']['same_top10_set']:>17.3f}"
            f"{row['served_vs_bfloat16_reference']['same_top10_set']:>13.3f}"
            f"{row['served_vs_float32']['same_up_to_ties']['0.03']:>17.3f}"
            f"{row['rounded_weights_vs_float32']['same_top10_set']:>17.3f}"
            f"{quality['float32 reference'][f'recall@{K}']:>10.4f}"
            f"{quality['bfloat16 served'][f'recall@{K}']:>13.4f}",
            flush=True,
        )
        for q, against in row.get("quantized", {}).items():
            print(
                f"  {q:<12} same set vs bf16 served "
                f"{against['vs_bfloat16_served']['same_top10_set']:.3f}, mean overlap "
                f"{against['vs_bfloat16_served']['mean_overlap']:.3f}; vs f32 "
                f"{against['vs_float32']['same_top10_set']:.3f}, overlap "
                f"{against['vs_float32']['mean_overlap']:.3f}; R@10 "
                f"{quality[f'{q} served'][f'recall@{K}']:.4f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
