"""Whole-request latency: xgr (device beam search, CUDA graphs) vs HF generate; GPU (--tiny: CPU).

Random-weight models of real shapes (Qwen3-1.7B, Qwen2.5-0.5B; bf16) serve a random catalog of
1M items (3 levels x 256 codes, and 4 x 256 for a subset). For each prompt length L, beam
width B (top_k = B) and batch size R it reports, per request (all requests of a batch finish
together): median and P99 wall time of ``Engine.recommend`` (host work included), the device
time of prefill and of the decode levels (CUDA events), the selection time per step (the
constrained beam step alone, replayed from a CUDA graph on the same shapes), the decode
forward (decode levels minus selection), peak GPU memory, and the fraction of the chip's
matrix rate (measured in the same run) that the bf16 arithmetic of the request would need at
that latency. HF transformers ``generate`` with the catalog trie as ``prefix_allowed_tokens_fn``
runs on the same weights (re-created from the same seed after xgr's runs, so each side's peak
memory is its own) for a few configurations, with its top-10 agreement to xgr.

    python benchmarks/e2e_latency.py --output benchmarks/results/e2e-latency.json
    python benchmarks/e2e_latency.py --tiny --output /tmp/e2e.json   # CPU smoke run

``--first-levels apart`` runs a single request's level-1 forward after level 0 instead of
within its prefill (``Engine``'s ``first_levels_together``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import graph_ms, run_environment, time_recommend  # noqa: E402

from xgr import Engine, ItemCatalog  # noqa: E402
from xgr.beam import BeamState, constrained_beam_step  # noqa: E402
from xgr.beam import step as step_module  # noqa: E402
from xgr.models.config import DecoderConfig  # noqa: E402
from xgr.models.decoder import CausalLM  # noqa: E402
from xgr.models.quantize import QUANTIZATIONS, quantize_fp8  # noqa: E402

CODEBOOK = 256
SHAPES = {
    "qwen3-1.7b": dict(
        model_type="qwen3", vocab_size=151936, hidden_size=2048, intermediate_size=6144,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=40960, tie_word_embeddings=True,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, tie_word_embeddings=True,
    ),
}  # fmt: skip
TINY = dict(
    model_type="qwen3", vocab_size=2000, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=4096, tie_word_embeddings=True,
)  # fmt: skip
# (shape, levels, L, B, R) run through HF generate too: the reference points of the
# comparison (HF takes seconds a request at these sizes).
HF_CONFIGS = [("qwen3-1.7b", 3, 1000, 256, 1), ("qwen2.5-0.5b", 3, 3000, 512, 1)]


def hf_model(shape: dict, device: str):
    """A random-weight HF model of the shape (bf16 on CUDA, float32 on the CPU)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(rms_norm_eps=1e-6, rope_theta=1e6, hidden_act="silu", **shape)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def xgr_model(hf) -> CausalLM:
    """xgr's model over the HF model's own weight tensors (no copy)."""
    cfg = DecoderConfig.from_hf(hf.config.to_dict())
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = dict(hf.state_dict())
    state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
    model.load_state_dict(state, assign=True, strict=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def random_catalog(num_items: int, levels: int, seed: int = 0) -> ItemCatalog:
    codes = np.random.default_rng(seed).integers(0, CODEBOOK, (num_items, levels))
    return ItemCatalog.from_codes([str(i) for i in range(num_items)], codes, CODEBOOK)


def sid_token_map(vocab: int, levels: int) -> np.ndarray:
    """Codes as the last levels x 256 vocabulary ids (as added tokens sit at a vocab's end)."""
    base = vocab - levels * CODEBOOK
    return base + np.arange(levels * CODEBOOK).reshape(levels, CODEBOOK)


def selection_ms(trie, device, requests: int, beam_width: int) -> list[float]:
    """Device ms of the constrained beam step of each level of ``trie`` (a ``PrefixTrie`` on
    ``device``), random scores, every beam live."""
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for depth, level in enumerate(trie.levels):
        prev = 1 if depth == 0 else beam_width
        nodes = torch.randint(0, level.num_parents, (requests, prev), device=device, generator=gen)
        scores = -torch.rand(requests, prev, device=device, generator=gen).sort(1, True).values
        state = BeamState(scores, nodes, nodes, nodes)
        log_probs = torch.log_softmax(
            torch.randn(requests, prev, CODEBOOK, device=device, generator=gen), -1
        )

        def step(state=state, log_probs=log_probs, level=level):
            constrained_beam_step(state, log_probs, level, None, beam_width, beam_width)

        out.append(graph_ms(step))
    return out


def request_flops(cfg: DecoderConfig, length: int, beam_width: int, levels: int) -> float:
    """bf16 FLOPs of one request: prefill, decode steps, full-vocabulary LM head."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layer = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    flops = 2 * length * layer * cfg.num_layers  # prefill projections and MLPs
    flops += 2 * length * length * q * cfg.num_layers  # causal attention (QK and PV, halved)
    flops += 2 * cfg.vocab_size * h  # LM head of the last prompt token
    for step in range(1, levels):
        flops += 2 * beam_width * layer * cfg.num_layers
        flops += 4 * beam_width * q * (length + step) * cfg.num_layers
        flops += 2 * beam_width * cfg.vocab_size * h
    return flops


def run_xgr(engine, cfg, length, beam_width, requests, reps, matmul_rate, device) -> dict:
    rng = np.random.default_rng(length + beam_width + requests)
    vocab_base = cfg.vocab_size - engine.catalog.num_levels * CODEBOOK
    prompts = [rng.integers(0, vocab_base, length).tolist() for _ in range(requests)]
    row, results = time_recommend(
        lambda: engine.recommend(prompts, beam_width=beam_width, top_k=beam_width), reps, device
    )
    levels = engine.catalog.num_levels
    row["reps"] = reps
    row["top10"] = [[c for c, _ in r.semantic_ids[:10]] for r in results]
    if device == "cuda":
        sel = selection_ms(engine.trie, engine.device, requests, beam_width)
        row["selection_ms_per_level"] = sel
        row["selection_ms"] = sum(sel)
        row["decode_forward_ms"] = row["decode_ms"] - row["selection_ms"]
        # The same steps selecting every pool by torch.topk (the engine's earlier choice).
        previous, step_module.POOL_TOPK = step_module.POOL_TOPK, "torch"
        try:
            row["selection_ms_per_level_torch_topk"] = selection_ms(
                engine.trie, engine.device, requests, beam_width
            )
        finally:
            step_module.POOL_TOPK = previous
        flops = requests * request_flops(cfg, length, beam_width, levels)
        row["flops"] = flops
        row["matmul_rate_fraction"] = flops / matmul_rate / (row["median_ms"] * 1e-3)
    return row


def hf_prefix_fn(catalog: ItemCatalog, sid_map: np.ndarray, prompt_len: int):
    """``prefix_allowed_tokens_fn`` over the catalog trie, built with numpy group-bys."""
    sids = catalog.semantic_ids
    levels = sids.shape[1]
    tokens = sid_map[np.arange(levels), sids]  # (num_sids, levels) token ids
    allowed = {}
    for depth in range(levels):
        order = np.lexsort(tokens[:, : depth + 1].T[::-1]) if depth else np.arange(len(tokens))
        ordered = tokens[order]
        if depth == 0:
            allowed[()] = sorted(set(ordered[:, 0].tolist()))
            continue
        prefix = ordered[:, :depth]
        cut = np.flatnonzero(np.any(prefix[1:] != prefix[:-1], axis=1)) + 1
        for group in np.split(ordered, cut):
            allowed[tuple(group[0, :depth].tolist())] = np.unique(group[:, depth]).tolist()
    fallback = [int(sid_map[0, 0])]

    def prefix_fn(batch_id, input_ids):
        return allowed.get(tuple(input_ids[prompt_len:].tolist()), fallback)

    return prefix_fn


def run_hf(hf, catalog, sid_map, cfg, length, beam_width, device) -> dict:
    rng = np.random.default_rng(length + beam_width + 1)
    prompt = rng.integers(0, cfg.vocab_size - sid_map.size, length).tolist()
    row = hf_generate(hf, prompt, catalog, sid_map, beam_width, length, device, pad_token_id=0)
    return {**row, "prompt": prompt}


# Timed HF generate calls per configuration, after one untimed call: a first call pays
# one-time costs (cuBLAS handles, kernel loading, the allocator's first growth); timed cold,
# one OneRec-like T5 request measured 459 ms in one run and 878 ms in another.
HF_RUNS = 3


def hf_generate(hf, prompt, catalog, sid_map, beam_width, skip: int, device, **options) -> dict:
    """HF ``generate`` (beam search, the catalog trie as prefix_allowed_tokens_fn, length
    penalty 0): median wall ms of ``HF_RUNS`` calls after an untimed one, every call's ms,
    its top-10 codes, and peak GPU GiB on CUDA.

    Args:
        skip: tokens of each output sequence before the codes (the prompt for a decoder-only
            model, the decoder start token for an encoder-decoder).
        options: further ``generate`` arguments.
    """
    prefix_fn = hf_prefix_fn(catalog, sid_map, skip)
    ids = torch.tensor([prompt], device=device)

    def generate():
        with torch.inference_mode():
            return hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                num_beams=beam_width,
                num_return_sequences=10,
                do_sample=False,
                length_penalty=0.0,
                max_new_tokens=catalog.num_levels,
                prefix_allowed_tokens_fn=prefix_fn,
                eos_token_id=None,
                **options,
            )

    generate()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(HF_RUNS):
        start = time.perf_counter()
        out = generate()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    row = {"hf_ms": statistics.median(times), "hf_runs_ms": times}
    levels = sid_map.shape[0]
    code_of = {int(sid_map[d, c]): c for d in range(levels) for c in range(CODEBOOK)}
    row["hf_top10"] = [[code_of[t] for t in seq[skip:]] for seq in out.tolist()]
    if device == "cuda":
        row["hf_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def matmul_flop_rate(device: str) -> float:
    if device != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    ms = graph_ms(lambda: a @ b, calls=3, replays=10)
    return 2 * 8192**3 / (ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument("--lengths", type=int, nargs="*", help="prompt lengths (default: all)")
    parser.add_argument("--beams", type=int, nargs="*", help="beam widths (default: all)")
    parser.add_argument("--batches", type=int, nargs="*", help="requests per batch (default: all)")
    parser.add_argument(
        "--first-levels",
        choices=("together", "apart"),
        default="together",
        help="a single request's level-1 forward within its prefill where the beam holds every"
        " first-level code (Engine's first_levels_together), or after level 0",
    )
    parser.add_argument(
        "--quantization",
        choices=("none", *QUANTIZATIONS),
        default="none",
        help="the decoder layers' projections in FP8 (xgr.models.quantize.quantize_fp8)",
    )
    args = parser.parse_args()
    together = args.first_levels == "together"
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        shapes, items, lengths, beams, batches, reps = (
            {"tiny": TINY},
            5000,
            (50, 120),
            (16, 32),
            (1, 2),
            3,
        )
        hf_configs = [("tiny", 3, 50, 16, 1)]
    else:
        shapes = {k: SHAPES[k] for k in args.shapes}
        items, lengths, beams, batches, reps = (
            1_000_000,
            (1000, 3000, 5000),
            (128, 256, 512),
            (1, 8),
            10,
        )
        hf_configs = HF_CONFIGS
    lengths, beams, batches = args.lengths or lengths, args.beams or beams, args.batches or batches
    hf_configs = [c for c in hf_configs if c[2] in lengths and c[3] in beams and c[4] in batches]
    rate = matmul_flop_rate(device)
    report = {
        "benchmark": "whole-request latency: prefill + levels (top_k = beam width)",
        "first_levels": args.first_levels,
        **run_environment(device),
        "dtype": "bfloat16" if device == "cuda" else "float32",
        "quantization": args.quantization,
        "catalog_items": items,
        "codebook": CODEBOOK,
        "bf16_matmul_flop_per_s": rate,
        "results": [],
        "hf": [],
    }
    catalogs = {levels: random_catalog(items, levels) for levels in (3, 4)}
    header = (
        f"{'shape':<13}{'lv':>3}{'L':>6}{'B':>5}{'R':>3}{'median':>9}{'p99':>9}{'prefill':>9}"
        f"{'decode':>8}{'select':>8}{'peak GiB':>9}{'rate':>6}"
    )
    lines = []
    print(header, flush=True)
    for name, shape in shapes.items():
        model = xgr_model(hf_model(shape, device))  # the HF model is dropped: peak memory
        model.fuse_projections()  # is xgr's alone; HF runs later on a re-created copy
        if args.quantization != "none":
            quantize_fp8(model, args.quantization)
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        cfg = model.config
        weights = sum(t.nbytes for t in {id(t): t for t in model.state_dict().values()}.values())
        report.setdefault("weights_gib", {})[name] = weights / 2**30
        engines = {}
        for levels in (3, 4):
            sid_map = sid_token_map(cfg.vocab_size, levels)
            engines[levels] = Engine(
                model, catalogs[levels], sid_map, name=name, first_levels_together=together
            )
        configs = [(3, *c) for c in itertools.product(lengths, beams, batches)]
        configs += [(4, lengths[0], beams[len(beams) // 2], r) for r in batches]
        for levels, length, beam_width, requests in configs:
            if device == "cuda":  # fresh graphs and prompt-KV pool: peak memory of this config
                for engine in engines.values():  # the other engine's pool would count too
                    engine.release_graphs()
                gc.collect()
                torch.cuda.empty_cache()
            try:
                row = run_xgr(
                    engines[levels], cfg, length, beam_width, requests, reps, rate, device
                )
            except torch.OutOfMemoryError as exc:
                row = {"error": f"out of memory: {exc}"[:300]}
            key = {"shape": name, "levels": levels, "prompt_len": length}
            key.update(beam_width=beam_width, top_k=beam_width, requests=requests)
            row = {**key, **row}
            report["results"].append(row)
            if "error" in row:
                lines.append(f"{name:<13}{levels:>3}{length:>6}{beam_width:>5}{requests:>3}  OOM")
            else:
                lines.append(
                    f"{name:<13}{levels:>3}{length:>6}{beam_width:>5}{requests:>3}"
                    f"{row['median_ms']:9.2f}{row['p99_ms']:9.2f}{row['prefill_ms']:9.2f}"
                    f"{row['decode_ms']:8.2f}{row.get('selection_ms', float('nan')):8.3f}"
                    f"{row.get('peak_gib', float('nan')):9.2f}"
                    f"{row.get('matmul_rate_fraction', float('nan')):6.2f}"
                )
            print(lines[-1], flush=True)
            args.output.write_text(json.dumps(report, indent=1) + "\n")
        for engine in engines.values():
            engine.release_graphs()
        del engines
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
        todo = [c for c in hf_configs if c[0] == name and not args.no_hf]
        hf = hf_model(shape, device) if todo else None  # same seed: the same weights
        for _, levels, length, beam_width, requests in todo:
            sid_map = sid_token_map(cfg.vocab_size, levels)
            try:
                row = run_hf(hf, catalogs[levels], sid_map, cfg, length, beam_width, device)
            except torch.OutOfMemoryError as exc:
                row = {"error": f"out of memory: {exc}"[:300]}
            mine = next(
                (r for r in report["results"] if r["shape"] == name and r["levels"] == levels
                 and r["prompt_len"] == length and r["beam_width"] == beam_width
                 and r["requests"] == requests and "error" not in r), None,
            )  # fmt: skip
            row = {"shape": name, "levels": levels, "prompt_len": length,
                   "beam_width": beam_width, "requests": requests, **row}  # fmt: skip
            if mine and "hf_ms" in row:
                row["xgr_median_ms"] = mine["median_ms"]
                row["speedup"] = row["hf_ms"] / mine["median_ms"]
                if "peak_gib" in mine:
                    row["memory_ratio"] = row["hf_peak_gib"] / mine["peak_gib"]
                # xgr on the HF prompt, for the top-10 comparison
                engine = Engine(model, catalogs[levels], sid_map, name=name, cuda_graphs=False)
                res = engine.recommend([row["prompt"]], beam_width=beam_width, top_k=beam_width)
                ours = {tuple(c) for c, _ in res[0].semantic_ids[:10]}
                row["top10_overlap"] = len(ours & {tuple(s) for s in row["hf_top10"]})
                del engine, res
            row.pop("prompt", None)
            report["hf"].append(row)
            if "hf_ms" in row and device != "cuda":
                summary = f"{row['hf_ms']:.0f} ms, top-10 overlap {row.get('top10_overlap')}/10"
            elif "hf_ms" in row:
                summary = (
                    f"{row['hf_ms']:.0f} ms, speed-up {row.get('speedup', float('nan')):.0f}x, "
                    f"memory {row.get('hf_peak_gib', float('nan')):.1f} GiB "
                    f"({row.get('memory_ratio', float('nan')):.0f}x less), "
                    f"top-10 overlap {row.get('top10_overlap')}/10"
                )
            else:
                summary = row["error"]
            print(f"HF {name} L={length} B={beam_width}: {summary}", flush=True)
            args.output.write_text(json.dumps(report, indent=1) + "\n")
        del hf, model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    # The rows again, after the HF lines, under the measured ceiling (not measured on the CPU).
    ceiling = f"bf16 matmul {rate / 1e12:.0f} TFLOP/s" if device == "cuda" else "CPU run"
    print(f"\n{ceiling}; times in ms per request (batch)")
    print("\n".join([header, *lines]))
    args.output.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
