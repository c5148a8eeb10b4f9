"""What item rules add to a request: the time to build one request's trie masks, and the whole
request with each rule against none.

A 1M-item catalog of 3 x 256 codes (random semantic IDs) with an integer attribute ``bucket``
(0-9, one tenth of the items each); rules: an allow-list of 10k items, an exclusion of 1k
items, and the filter ``{"bucket": 3}`` (10% of the items). The request is one prompt of the
Qwen3-1.7B shape (random weights), L=1000, beam 256, bf16 on the GPU. Rule times are host
time of ``request_rules`` (item ids to catalog rows, the filter checked); mask times are
wall time of ``CatalogMasks.masks`` to the device's end (host and device work); medians.

    python benchmarks/filters.py --output benchmarks/results/filters.json   # GPU
    python benchmarks/filters.py --tiny --output /tmp/filters.json         # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from e2e_latency import SHAPES, TINY, hf_model, random_catalog, sid_token_map, xgr_model  # noqa: E402
from timing import run_environment, time_recommend  # noqa: E402

from xgr import Engine  # noqa: E402
from xgr.catalog.rules import request_rules  # noqa: E402


def rules_of(catalog, name: str, rng) -> dict:
    """``Engine.recommend``'s rule arguments of one named rule, for one prompt."""
    items = catalog.item_ids
    if name == "allow 10k items":
        return {"allow_item_ids": [list(rng.choice(items, 10_000, replace=False))]}
    if name == "exclude 1k items":
        return {"exclude_item_ids": [list(rng.choice(items, 1_000, replace=False))]}
    if name == "filter passing 10%":
        return {"item_filter": [{"bucket": 3}]}
    return {}


def rules_ms(engine, rules: dict, reps: int) -> float:
    """Median host ms of reading one request's rules (ids to catalog rows, the filter)."""
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        request_rules(engine.catalog, 1, **rules)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def mask_ms(engine, rules: dict, device: str, reps: int) -> float:
    """Median wall ms of building one request's masks, to the device's end."""
    parsed = request_rules(engine.catalog, 1, **rules)
    times = []
    for _ in range(reps + 2):
        start = time.perf_counter()
        engine.catalog_masks.masks(parsed)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    shape, items, length, beam = (TINY, 20_000, 100, 32) if args.tiny else (
        SHAPES["qwen3-1.7b"], 1_000_000, 1000, 256)  # fmt: skip
    reps = 3 if args.tiny else args.reps
    catalog = random_catalog(items, 3)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        table = Path(tmp) / "attributes.csv"
        buckets = rng.integers(0, 10, items)
        rows = "\n".join(f"{i},{b}" for i, b in zip(catalog.item_ids, buckets, strict=True))
        table.write_text("item_id,bucket\n" + rows + "\n")
        catalog.load_attributes(table)
    model = xgr_model(hf_model(shape, device))
    engine = Engine(model, catalog, sid_token_map(model.config.vocab_size, 3))
    vocab = model.config.vocab_size - 3 * 256
    prompt = rng.integers(0, vocab, length).tolist()
    report = {
        "benchmark": "item rules: one request's trie masks, and the whole request with each",
        **run_environment(device),
        "catalog_items": items,
        "prompt_len": length,
        "beam_width": beam,
        "results": [],
    }
    print(
        f"{'rule':<22}{'rules ms':>9}{'mask ms':>9}{'request ms':>12}{'p99':>9}{'added':>8}"
        f"{'items':>7}"
    )
    base = None
    for name in ("none", "allow 10k items", "exclude 1k items", "filter passing 10%"):
        rules = rules_of(catalog, name, rng)
        masks = mask_ms(engine, rules, device, reps) if rules else 0.0
        host = rules_ms(engine, rules, reps) if rules else 0.0

        def recommend(rules=rules):
            return engine.recommend([prompt], beam, beam, 10, **rules)

        row, results = time_recommend(recommend, reps, device)
        base = row["median_ms"] if base is None else base
        row.update(rule=name, rules_host_ms=host, mask_ms=masks, added_ms=row["median_ms"] - base,
                   items_returned=len(results[0].items))  # fmt: skip
        report["results"].append(row)
        print(
            f"{name:<22}{host:9.3f}{masks:9.3f}{row['median_ms']:12.2f}{row['p99_ms']:9.2f}"
            f"{row['added_ms']:8.3f}{row['items_returned']:7d}",
            flush=True,
        )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
