"""A request whose prompt carries given input embeddings (``xgr.Prompt``) against the same
request of tokens only.

One prompt of the Qwen3-1.7B shape (random weights, bf16 on the GPU), L=1000, beam 256,
over a random 1M-item catalog (3 x 256 codes): all 1,000 positions tokens, against 256 of
them given as embeddings (four spans of 64 rows). The two alternate over several rounds in
one run; the ratio is of their medians.

    python benchmarks/prompt_embeds.py --output benchmarks/results/prompt-embeds.json   # GPU
    python benchmarks/prompt_embeds.py --tiny --output /tmp/prompt-embeds.json         # CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from e2e_latency import SHAPES, TINY, hf_model, random_catalog, sid_token_map, xgr_model  # noqa: E402
from timing import run_environment, time_recommend  # noqa: E402

from xgr import Engine, Prompt  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape, items, length, beam, span_rows = (TINY, 20_000, 100, 32, 8) if args.tiny else (
        SHAPES["qwen3-1.7b"], 1_000_000, 1000, 256, 64)  # fmt: skip
    reps = 3 if args.tiny else args.reps
    model = xgr_model(hf_model(shape, device))
    engine = Engine(model, random_catalog(items, 3), sid_token_map(model.config.vocab_size, 3))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size - 3 * 256, length).tolist()
    hidden = model.config.hidden_size
    scale = float(model.model.embed_tokens.weight.detach().float().std())
    offsets = [i * length // 4 for i in range(4)]
    spans = [(o, torch.randn(span_rows, hidden) * scale) for o in offsets]
    variants = {
        "tokens": [tokens],
        f"{4 * span_rows} positions as embeddings": [Prompt(token_ids=tokens, embeds=spans)],
    }
    rows = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name, prompts in variants.items():

            def recommend(prompts=prompts):
                return engine.recommend(prompts, beam, beam, 10)

            row, _ = time_recommend(recommend, reps, device)
            rows[name].append(row)
    report = {
        "benchmark": "a request with given input embeddings against tokens only",
        **run_environment(device),
        "prompt_len": length,
        "beam_width": beam,
        "embedded_positions": 4 * span_rows,
        "results": [],
    }
    base = None
    print(f"{'prompt':<30}{'median ms':>10}{'prefill':>9}{'decode':>8}{'ratio':>7}")
    for name, runs in rows.items():
        median = statistics.median(r["median_ms"] for r in runs)
        base = median if base is None else base
        summary = {
            "prompt": name,
            "median_ms": median,
            "rounds_median_ms": [r["median_ms"] for r in runs],
            "prefill_ms": statistics.median(r["prefill_ms"] for r in runs),
            "decode_ms": statistics.median(r["decode_ms"] for r in runs),
            "ratio": median / base,
        }
        report["results"].append(summary)
        print(
            f"{name:<30}{median:10.3f}{summary['prefill_ms']:9.3f}{summary['decode_ms']:8.3f}"
            f"{summary['ratio']:7.3f}"
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
