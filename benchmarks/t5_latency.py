"""Encoder-decoder (T5) request latency: xgr against HF transformers' T5 beam search; GPU.

Random-weight T5 models of two shapes serve a random catalog of 1M items (3 levels x 256
codes): a TIGER-size model (d_model 128, 4 + 4 layers, 6 heads, d_ff 1024, a vocabulary of
only the codes) and a larger OneRec-like one (d_model 1024, 12 + 12 layers, 16 heads, d_ff
4096, gated GELU, T5's 32,128-token vocabulary with the codes as its last ids). For each
history length (tokens) and beam width (top_k = beam width) it reports, for one request, the
median and P99 wall time of ``Engine.recommend``, the device time of the encoder (prefill)
and of the decode levels, and peak GPU memory. HF ``T5ForConditionalGeneration.generate``
(num_beams = beam width, the catalog trie as ``prefix_allowed_tokens_fn``, length_penalty 0)
runs on the same weights for the configurations in ``HF_CONFIGS``, with the speed-up, the
peak-memory ratio and the top-10 overlap of the two.

``--encoder-attention sdpa`` runs the encoder's CUDA graph with SDPA and the square mask
instead of xgr's Triton attention (the default: position bias read per offset).
``--first-levels apart`` runs the decoder start step and level 1's forward one after the
other instead of in one pass (``Engine``'s ``first_levels_together``).

With ``--profile`` it also prints (and stores in the JSON) the kernels of the last HF
configuration's request, eager so that the profiler sees each kernel: device time per kernel
family and the top kernels, for the encoder and for the decode levels.

    python benchmarks/t5_latency.py --output benchmarks/results/t5-latency.json [--profile]
    python benchmarks/t5_latency.py --tiny --output /tmp/t5.json   # CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e_latency import CODEBOOK, hf_generate, random_catalog, sid_token_map  # noqa: E402
from timing import run_environment, time_recommend  # noqa: E402

from xgr import Engine  # noqa: E402
from xgr.models import t5 as t5_module  # noqa: E402

LEVELS = 3
SPECIAL_TOKENS = 2  # pad (also the decoder start token) and eos
SHAPES = {
    "t5-tiger": dict(
        d_model=128, d_kv=64, d_ff=1024, num_layers=4, num_decoder_layers=4, num_heads=6,
        feed_forward_proj="relu", vocab_size=SPECIAL_TOKENS + LEVELS * CODEBOOK,
    ),
    "t5-onerec-like": dict(
        d_model=1024, d_kv=64, d_ff=4096, num_layers=12, num_decoder_layers=12, num_heads=16,
        feed_forward_proj="gated-gelu", vocab_size=32128,
    ),
}  # fmt: skip
TINY = dict(
    d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
    feed_forward_proj="relu", vocab_size=SPECIAL_TOKENS + LEVELS * CODEBOOK,
)  # fmt: skip
HISTORIES = (256, 1024)
BEAMS = (256, 512)
# (shape, history tokens, beam width) also run through HF; the OneRec-like one is the main
# comparison.
HF_CONFIGS = [("t5-tiger", 256, 256), ("t5-onerec-like", 1024, 512)]


def write_t5(shape: dict, folder: Path, dtype: torch.dtype) -> None:
    """Save a random-weight HF T5 model of ``shape`` to ``folder`` (seeded: reproducible)."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, tie_word_embeddings=False,
        **shape,
    )  # fmt: skip
    torch.manual_seed(0)
    T5ForConditionalGeneration(config).to(dtype).save_pretrained(folder)


def history(rng: np.random.Generator, sid_map: np.ndarray, tokens: int) -> list[int]:
    """A history of tokens // LEVELS random items, as their code tokens (TIGER's input)."""
    codes = rng.integers(0, CODEBOOK, (tokens // LEVELS, LEVELS))
    return sid_map[np.arange(LEVELS), codes].reshape(-1).tolist()


def run_xgr(engine: Engine, prompt: list[int], beam_width: int, reps: int, device) -> dict:
    row, (result,) = time_recommend(
        lambda: engine.recommend([prompt], beam_width, beam_width, num_results=10), reps, device
    )
    return {**row, "top10": [list(codes) for codes, _ in result.semantic_ids]}


def run_hf(folder: Path, prompt, catalog, sid_map, beam_width, dtype, device) -> dict:
    from transformers import T5ForConditionalGeneration

    hf = T5ForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    # Decoder ids are the start token, then the codes: the trie reads them from index 1.
    row = hf_generate(hf, prompt, catalog, sid_map, beam_width, 1, device)
    del hf
    return row


def profile_t5(folder: Path, catalog, sid_map, prompt, beam_width, dtype, device) -> dict:
    """Device time per kernel family and the top kernels of one request, eager (so the
    profiler sees each kernel), split into the encoder and the decode levels."""
    from profile_request import profile_phases

    from xgr.engine.generate import allocate_shared_kv
    from xgr.engine.inputs import prepare_inputs
    from xgr.engine.search import search_levels
    from xgr.runner import LevelBatch

    engine = Engine.from_pretrained(
        folder, catalog, device=device, dtype=dtype, sid_token_ids=sid_map, cuda_graphs=False
    )
    engine.recommend([prompt], beam_width, beam_width)  # compiles the Triton kernels
    with torch.inference_mode():
        inputs = prepare_inputs([prompt], engine.device)
        shared = allocate_shared_kv(engine.model, inputs)
        prefilled = []  # the encoder's output, for the decode phase
        batch = LevelBatch(shared, inputs.prompt_lens, inputs.cu_seqlens_host)
        together = engine.runner.first_levels_together(1, beam_width)
        phases = {
            "encoder": lambda: prefilled.append(
                engine.runner.prefill(inputs.prefill_batch(shared))
            ),
            "decode levels": lambda: search_levels(
                engine.decode_spec, batch, prefilled[0], beam_width, beam_width, together
            ),
        }
        report, lines = profile_phases(phases, device == "cuda")
    print("\n".join(lines))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true", help="small shapes on the CPU (smoke)")
    parser.add_argument("--shapes", nargs="*", default=list(SHAPES))
    parser.add_argument("--no-hf", action="store_true", help="skip HF transformers")
    parser.add_argument(
        "--encoder-attention",
        choices=("sdpa", "triton"),
        default=t5_module.ENCODER_ATTENTION,
        help="the encoder graph's attention (xgr.models.t5.ENCODER_ATTENTION); the CUDA-graph"
        " path only: --tiny and --profile run the encoder eagerly",
    )
    parser.add_argument(
        "--first-levels",
        choices=("together", "apart"),
        default="together",
        help="the decoder start step and level 1's forward in one pass where the beam holds"
        " every first-level code (Engine's first_levels_together), or one after the other",
    )
    parser.add_argument(
        "--reps", type=int, default=10, help="timed xgr requests per configuration (GPU)"
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile the kernels of the last HF configuration's request",
    )
    args = parser.parse_args()
    t5_module.ENCODER_ATTENTION = args.encoder_attention
    together = args.first_levels == "together"
    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.tiny:
        shapes, items, histories, beams, reps = {"tiny": TINY}, 5000, (30, 90), (16,), 3
        hf_configs = [("tiny", 90, 16)]
    else:
        shapes = {k: SHAPES[k] for k in args.shapes}
        items, histories, beams, reps = 1_000_000, HISTORIES, BEAMS, args.reps
        hf_configs = HF_CONFIGS
    report = {
        "benchmark": "T5 encoder-decoder, one request: xgr vs HF beam search (top_k = beam)",
        **run_environment(device),
        "dtype": str(dtype).removeprefix("torch."),
        "catalog_items": items,
        "levels": LEVELS,
        "codebook": CODEBOOK,
        "encoder_attention": args.encoder_attention,
        "first_levels": args.first_levels,
        "xgr_reps": reps,
        "results": [],
    }
    catalog = random_catalog(items, LEVELS)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    print(f"{'shape':<16}{'hist':>6}{'B':>5}{'median':>9}{'p99':>9}{'encode':>8}{'decode':>8}"
          f"{'peak GiB':>9}{'HF ms':>9}{'speed-up':>9}{'top10':>6}", flush=True)  # fmt: skip
    for name, shape in shapes.items():
        sid_map = sid_token_map(shape["vocab_size"], LEVELS)
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            write_t5(shape, folder, dtype)
            engine = Engine.from_pretrained(
                folder, catalog, device=device, dtype=dtype, sid_token_ids=sid_map,
                first_levels_together=together,
            )  # fmt: skip
            for length, beam_width in itertools.product(histories, beams):
                prompt = history(np.random.default_rng(length + beam_width), sid_map, length)
                row = {"shape": name, "history_tokens": len(prompt), "beam_width": beam_width}
                row.update(run_xgr(engine, prompt, beam_width, reps, device))
                if not args.no_hf and (name, length, beam_width) in hf_configs:
                    gc.collect()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    row.update(run_hf(folder, prompt, catalog, sid_map, beam_width, dtype, device))
                    row["speed_up"] = row["hf_ms"] / row["median_ms"]
                    if "peak_gib" in row:
                        row["memory_ratio"] = row["hf_peak_gib"] / row["peak_gib"]
                    mine = {tuple(c) for c in row["top10"]}
                    row["top10_overlap"] = len(mine & {tuple(c) for c in row["hf_top10"]})
                if args.profile and (name, length, beam_width) == hf_configs[-1]:
                    row["profile"] = profile_t5(
                        folder, catalog, sid_map, prompt, beam_width, dtype, device
                    )
                report["results"].append(row)
                args.output.write_text(json.dumps(report, indent=1) + "\n")
                hf_cols = (
                    f"{row['hf_ms']:9.1f}{row['speed_up']:9.1f}{row['top10_overlap']:6d}"
                    if "hf_ms" in row
                    else ""
                )
                print(
                    f"{name:<16}{len(prompt):>6}{beam_width:>5}{row['median_ms']:9.2f}"
                    f"{row['p99_ms']:9.2f}{row['prefill_ms']:8.2f}{row['decode_ms']:8.2f}"
                    f"{row.get('peak_gib', float('nan')):9.2f}{hf_cols}",
                    flush=True,
                )
            del engine
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
