"""Beam-step selection time per level on the GPU: the pool top-k choices side by side.

The constrained beam step of each level, with each request's pool selected by Triton's
chunked bitonic top-k ("triton"), the same skipping the chunks below xBeam's
early-termination bound ("xbeam", ``xgr.beam.step.early_termination_bound`` from each
beam's best candidate; "xbeam-4" from each beam's best four), ``torch.topk``
("torch"), and the engine's measured choice ("auto"), in one run. Every mode's beams are
checked equal to the torch reference step's.

A random catalog of 1M items (3 levels x 256 codes, as ``e2e_latency.py``): level 0 is the
root's 256 codes, level 1 a dense table (each beam's 256 codes), level 2 a CSR level (a few
children per beam). Every beam is live; top_k = beam width. Two score distributions:
"uniform" (log-softmax of unit normal logits, beam scores spread over 1 nat: every beam
competes, the bound prunes little) and "peaked" (logits of scale 3 and beam scores spread
over 8 nats, closer to a trained model's: the weaker beams cannot reach the winners).
Times are device us per step from CUDA-graph replays (``timing.graph_ms``).

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
from e2e_latency import CODEBOOK, random_catalog  # noqa: E402
from timing import graph_ms, run_environment  # noqa: E402

from xgr.beam import BeamState, constrained_beam_step  # noqa: E402
from xgr.beam import step as step_module  # noqa: E402

BEAM_WIDTHS = (256, 512)
REQUESTS = (1, 8)
# (pool top-k, each beam's candidates the xbeam bound is taken from)
MODES = {"auto": ("auto", 1), "triton": ("triton", 1), "xbeam": ("xbeam", 1),
         "xbeam-4": ("xbeam", 4), "torch": ("torch", 1)}  # fmt: skip
# (logit scale, spread of the beams' scores in nats)
DISTRIBUTIONS = {"uniform": (1.0, 1.0), "peaked": (3.0, 8.0)}


def level_inputs(level, depth, requests, beam_width, distribution, device):
    """A level's beams before the step and their code log-probabilities."""
    scale, spread = DISTRIBUTIONS[distribution]
    gen = torch.Generator(device=device).manual_seed(depth)
    prev = 1 if depth == 0 else beam_width
    nodes = torch.randint(0, level.num_parents, (requests, prev), device=device, generator=gen)
    scores = -spread * torch.rand(requests, prev, device=device, generator=gen)
    state = BeamState(scores.sort(1, True).values, nodes, nodes, nodes)
    logits = scale * torch.randn(requests, prev, CODEBOOK, device=device, generator=gen)
    return state, torch.log_softmax(logits, -1)


def same_beams(got: BeamState, want: BeamState) -> bool:
    """The same scores, and the same nodes wherever a score is not tied within its request
    (the order among equal scores is the top-k's own, unspecified for ``torch.topk``)."""
    scores, nodes = got.scores.cpu(), got.nodes.cpu()
    if not torch.equal(scores, want.scores):
        return False
    ties = (want.scores[:, 1:] == want.scores[:, :-1]).float()
    tied = torch.nn.functional.pad(ties, (1, 0)) + torch.nn.functional.pad(ties, (0, 1)) > 0
    return bool(torch.equal(nodes[~tied], want.nodes[~tied]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--items", type=int, default=1_000_000)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("this benchmark needs a CUDA GPU (it times CUDA-graph replays)")
    device = torch.device("cuda")
    trie = random_catalog(args.items, 3).trie
    on_device = trie.to("cuda")
    rows = []
    print(
        f"{'scores':<8}{'B':>5}{'R':>3} {'mode':<7}" + "".join(f"{f'L{i} us':>9}" for i in range(3))
    )
    for distribution, beam_width, requests in itertools.product(
        DISTRIBUTIONS, BEAM_WIDTHS, REQUESTS
    ):
        inputs = [
            level_inputs(level, depth, requests, beam_width, distribution, device)
            for depth, level in enumerate(on_device.levels)
        ]
        want = [
            constrained_beam_step(
                BeamState(*(t.cpu() for t in (s.scores, s.nodes, s.codes, s.parents))),
                lp.cpu(), level, None, beam_width, beam_width,
            )
            for (s, lp), level in zip(inputs, trie.levels, strict=True)
        ]  # fmt: skip
        for mode, (pool_topk, per_beam) in MODES.items():
            step_module.POOL_TOPK, step_module.XBEAM_CANDIDATES_PER_BEAM = pool_topk, per_beam
            times = []
            for (state, log_probs), level, expected in zip(
                inputs, on_device.levels, want, strict=True
            ):
                got = constrained_beam_step(state, log_probs, level, None, beam_width, beam_width)
                if not same_beams(got, expected):
                    raise SystemExit(f"{mode} differs from the reference step ({distribution})")

                def step(state=state, log_probs=log_probs, level=level, beam=beam_width):
                    constrained_beam_step(state, log_probs, level, None, beam, beam)

                times.append(graph_ms(step))
            rows.append(
                {"scores": distribution, "beam_width": beam_width, "requests": requests,
                 "pool_topk": mode, "ms": times}
            )  # fmt: skip
            print(
                f"{distribution:<8}{beam_width:>5}{requests:>3} {mode:<7}"
                + "".join(f"{ms * 1e3:9.1f}" for ms in times),
                flush=True,
            )
    step_module.POOL_TOPK, step_module.XBEAM_CANDIDATES_PER_BEAM = "auto", 1
    report = {
        "benchmark": "constrained beam step per level (selection), pool top-k choices",
        **run_environment(),
        "catalog_items": args.items,
        "distributions": {k: {"logit_scale": a, "beam_score_spread_nats": b}
                          for k, (a, b) in DISTRIBUTIONS.items()},
        "results": rows,
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
