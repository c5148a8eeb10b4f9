"""Beam-step selection time per level on the GPU, Triton vs torch.topk pool top-k.

The constrained beam step of each level, with each request's pool selected by Triton's
chunked bitonic top-k, by ``torch.topk``, and by the engine's measured choice between them
("auto"), side by side in one run.

A random catalog of 1M items (3 levels x 256 codes, as ``e2e_latency.py``): level 0 is the
root's 256 codes, level 1 a dense table (each beam's 256 codes), level 2 a CSR level (a few
children per beam). Every beam is live, scores random; top_k = beam width. Times are device
ms per step from CUDA-graph replays (``timing.graph_ms``).

    python benchmarks/selection.py --output benchmarks/results/selection.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import random_catalog, selection_ms  # noqa: E402
from timing import run_environment  # noqa: E402

from xgr.beam import step as step_module  # noqa: E402

BEAM_WIDTHS = (256, 512)
REQUESTS = (1, 8)
MODES = ("auto", "triton", "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--items", type=int, default=1_000_000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (it times CUDA-graph replays)")
    trie = random_catalog(args.items, 3).trie.to("cuda")
    rows = []
    print(
        f"{'B':>5}{'R':>3} {'pool top-k':<10}" + "".join(f"{f'level {i} us':>12}" for i in range(3))
    )
    for beam_width, requests, mode in itertools.product(BEAM_WIDTHS, REQUESTS, MODES):
        step_module.POOL_TOPK = mode
        levels = selection_ms(trie, torch.device("cuda"), requests, beam_width)
        rows.append(
            {"beam_width": beam_width, "requests": requests, "pool_topk": mode, "ms": levels}
        )
        print(
            f"{beam_width:>5}{requests:>3} {mode:<10}"
            + "".join(f"{ms * 1e3:12.1f}" for ms in levels),
            flush=True,
        )
    step_module.POOL_TOPK = MODES[0]
    report = {
        "benchmark": "constrained beam step per level (selection), Triton vs torch pool top-k",
        **run_environment(),
        "catalog_items": args.items,
        "results": rows,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
