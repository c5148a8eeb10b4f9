"""How the Triton decode attention (``xgr.kernels.triton_decode_attention``) is launched:
its tile sizes and the split of a request's prompt over several programs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from xgr.kernels.device import multiprocessor_count

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)  # head sizes the decode-attention kernel is built for


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and parallelism of one launch.

    Attributes:
        block_m: (beam, head) rows per program.
        block_n: prompt tokens per loop step; None: 128 for head_dim <= 64, else 64.
        num_warps, num_stages: Triton's warps per program and software-pipeline depth.
        num_splits: programs sharing one request's prompt (split-KV, merged exactly by
            log-sum-exp in a second launch); None: ``choose_num_splits``.
        merge_block_m, merge_num_warps: rows and warps per program of that second launch
            (the merge and the beams' own tokens), which moves data and does little
            arithmetic, so it wants many small programs in flight.

    The defaults come from H200 runs of ``benchmarks/attention.py --sweep`` (CUDA-graph
    timing): at L=3000, B=512, one request, 64 x 64 tiles with 4 warps and 3 stages in two
    splits took 35.2 us (Qwen3-1.7B shape), against 39.6 us in one split and 36.6 us for
    128-row tiles with 8 warps; the split count follows ``choose_num_splits``. Nsight Compute
    then showed the merge launch with the shared stage's 64-row tiles taking 8.2 us of the
    ~39 (one 4-warp program per SM, 174 registers, 1.8 TB/s), hence its own smaller tiles.
    In graph replays that is within the run-to-run drift there (34.2 us in all against
    34.6-35.7 us with 64-row merge tiles), but it pays where many splits meet few rows: at
    B=128, one request (8 splits, Qwen3-1.7B shape) 11.1 / 17.9 / 23.3 us at L=1000 / 3000 /
    5000 against 18.7 / 25.1 / 32.3 us before.

    Raises:
        ValueError: a tile size or warp count that is not a positive power of two, a
            non-positive stage or split count.
    """

    block_m: int = 64
    block_n: int | None = None
    num_warps: int = 4
    num_stages: int = 3
    num_splits: int | None = None
    merge_block_m: int = 16
    merge_num_warps: int = 4

    def __post_init__(self) -> None:
        # Triton's tiles (tl.arange) and warp counts must be powers of two; a zero or
        # negative size would launch an empty grid and leave the output unwritten.
        for name in ("block_m", "block_n", "num_warps", "merge_block_m", "merge_num_warps"):
            value = getattr(self, name)
            if name == "block_n" and value is None:  # None: chosen from head_dim
                continue
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"LaunchConfig.{name} must be a positive power of two: {value!r}")
        if not isinstance(self.num_stages, int) or self.num_stages < 1:
            raise ValueError(f"LaunchConfig.num_stages must be >= 1: {self.num_stages!r}")
        if self.num_splits is not None and (
            not isinstance(self.num_splits, int) or self.num_splits < 1
        ):
            raise ValueError(f"LaunchConfig.num_splits must be None or >= 1: {self.num_splits!r}")


DEFAULT_LAUNCH = LaunchConfig()
# Cross-attention (one query head a KV head, head_dim <= 64) with 64-token key tiles: on an
# H200 (bf16, T5 OneRec-like and TIGER-size shapes, 12 layers' K/V cycled, CUDA-graph
# timing; benchmarks/results/t5-cross-attention-sweep-s13-*) the 128-token default took
# 8.3 / 11.6 / 13.6 us a layer for 1 / 256 / 512 query rows over a 1023-token history
# against 7.8 / 10.7 / 13.4 with 64, 59.2 against 47.0 for 8 requests of 512 rows, and
# 7.8 against 6.4 for TIGER's 256 rows over 255 tokens. Grouped-query shapes keep 128.
CROSS_ATTENTION_LAUNCH = LaunchConfig(block_n=64)
MAX_SPLITS = 8


def choose_num_splits(programs: int, device: torch.device) -> int:
    """Split count for a grid of ``programs`` programs per split (row blocks x heads x requests).

    A grid that fills the SMs runs in one fused launch. A smaller one is split so each SM
    gets about two programs (the default tiles' shared memory fits two per SM), and at
    least two splits: a 64-row tile runs one warpgroup, and a second program on the SM
    overlaps its softmax with the first one's matrix products. Measured on an H200
    (``benchmarks/attention.py --split-sweep``, CUDA-graph timing, bf16, one request,
    ``results/attention-splits-2026-11-29-h200.json``), us per layer and step for 1/2/4/8
    splits, Qwen3-1.7B shape:

    - B=512 (128 programs: 2 splits) at L=3000: 39.7 / 34.1 / 39.4 / 54.1;
    - B=256 (64: 4 splits) at L=3000: 39.2 / 25.5 / 22.0 / 28.7, at L=5000: 60.0 / 35.6 /
      29.9 / 36.4 (the earlier rule, one program per SM, chose 2);
    - B=128 (32: 8 splits) at L=5000: 60.6 / 34.3 / 21.9 / 21.1, but at L=1000 18.2 / 13.4 /
      11.3 / 12.9 (125 tokens a split: too few to pay for the merge). The prompt lengths
      are device values inside the CUDA graphs, so the rule cannot look at them.

    Qwen2.5-0.5B (7 query heads a KV head) follows the same pattern (B=256: 4 splits best
    at every L; B=128: 8 splits best at L >= 3000).

    Returns:
        1 .. MAX_SPLITS; always 1 off CUDA.
    """
    if device.type != "cuda":
        return 1
    sms = multiprocessor_count(device)
    if programs > sms:
        return 1
    return max(2, min(MAX_SPLITS, 2 * sms // programs))
