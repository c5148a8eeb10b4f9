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

    The defaults are the fastest launch of ``benchmarks/attention.py --sweep`` for one
    request at L=3000, B=512: 64 x 64 tiles with 4 warps and 3 stages beat one split and
    128-row tiles with 8 warps; the split count follows ``choose_num_splits``. The merge
    launch has its own smaller tiles: with the shared stage's 64-row tiles it ran one
    program per SM, and 16-row tiles pay where many splits meet few rows (beam 128, one
    request). Figures and rejected variants: docs/performance.md.

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
# Cross-attention (one query head a KV head, head_dim <= 64) with 64-token key tiles: they
# beat the 128-token default at every T5 OneRec-like and TIGER-size shape of the launch
# sweep, most for batches of requests (docs/performance.md). Grouped-query shapes keep 128.
CROSS_ATTENTION_LAUNCH = LaunchConfig(block_n=64)
MAX_SPLITS = 8


def choose_num_splits(programs: int, device: torch.device) -> int:
    """Split count for a grid of ``programs`` programs per split (row blocks x heads x requests).

    A grid that fills the SMs runs in one fused launch. A smaller one is split so each SM
    gets about two programs (the default tiles' shared memory fits two per SM), and at
    least two splits: a 64-row tile runs one warpgroup, and a second program on the SM
    overlaps its softmax with the first one's matrix products. In
    ``benchmarks/attention.py --split-sweep`` this count was the fastest for both Qwen
    shapes at beams 128-512, except for short prompts at beam 128, where a split holds too
    few tokens to pay for the merge; the prompt lengths are device values inside the CUDA
    graphs, so the rule cannot look at them
    (docs/performance.md).

    Returns:
        1 .. MAX_SPLITS; always 1 off CUDA.
    """
    if device.type != "cuda":
        return 1
    sms = multiprocessor_count(device)
    if programs > sms:
        return 1
    return max(2, min(MAX_SPLITS, 2 * sms // programs))
