"""Gate/up projection with the gated activation in its epilogue: act(x G^T) * (x U^T) as one
GEMM (Shazeer, "GLU Variants Improve Transformer", 2020).

cuBLAS writes the (T, 2I) gate/up projection and a second pass reads it back to write the
(T, I) product, so at prefill row counts that pass moves three times the bytes of its
result. Here an output tile holds the gate and up columns of the same features: the
weight's rows are interleaved (gate 0, up 0, gate 1, up 1, ...;
``xgr.layers.linear.interleave_gate_up``), so
each column pair of the accumulator splits into gate and up in registers and the tile
writes act(gate) * up directly.

The GEMM is a persistent grid over the output tiles (one program per SM, tiles grouped
along M so the weight columns they share stay in L2), its operands loaded through TMA
tensor descriptors (Hopper's bulk copy engine), the loop over the tiles flattened with the
loop over K so the next tile's loads overlap this tile's epilogue (the structure of
Triton's persistent-matmul tutorial, written anew here).

The epilogue rounds where the torch ops it replaces (``gated_linear_reference``) round: the
projection, then the activation, then the product, each in the model dtype. Only the
GEMM's accumulation order can differ from cuBLAS's.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from xgr.kernels.device import multiprocessor_count
from xgr.kernels.triton_elementwise import GATE_ACTIVATIONS, TORCH_ACTIVATIONS, activation

# (BLOCK_M, BLOCK_N, BLOCK_K, stages, warps) per dtype. Half types: 128 x 256 tiles with
# 64-deep K steps, 3 stages and 8 warps beat cuBLAS + the activation pass at prefill row
# counts of both Qwen gate/up shapes in the sweep; smaller tiles were slower
# (docs/performance.md). float32 (no tensor-core tf32: the engine's float32
# path is exact) needs twice the shared memory per element: half the tile.
LAUNCH = {
    torch.bfloat16: (128, 256, 64, 3, 8),
    torch.float16: (128, 256, 64, 3, 8),
    torch.float32: (64, 128, 32, 2, 4),
}


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of output tile ``tile``: GROUP_M row blocks sweep each
    column block in turn, so those weight tiles are read from L2 after the first."""
    in_group = GROUP_M * num_n
    first_m = (tile // in_group) * GROUP_M
    group_rows = min(num_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % group_rows, (tile % in_group) // group_rows


@triton.jit
def _gated_tile(acc, ACT: tl.constexpr, dtype: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """act(gate) * up of a (BM, BN) accumulator whose column pairs are (gate, up): (BM, BN / 2)."""
    gate, up = acc.reshape(BM, BN // 2, 2).split()  # each thread holds its column pairs
    gate = gate.to(dtype).to(tl.float32)
    act = activation(gate, ACT).to(dtype).to(tl.float32)
    return (act * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def _gated_linear_tile(
    tile, x_desc, w_desc, out_desc, num_m, num_n, K: tl.constexpr, ACT: tl.constexpr,
    PRECISION: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
    acc = tl.zeros((BM, BN), tl.float32)
    for k in range(0, K, BK):
        a = x_desc.load([pid_m * BM, k])
        w = w_desc.load([pid_n * BN, k])
        acc = tl.dot(a, w.T, acc, input_precision=PRECISION)
    out_desc.store([pid_m * BM, pid_n * (BN // 2)], _gated_tile(acc, ACT, out_desc.dtype, BM, BN))


@triton.jit
def _gated_linear_kernel(
    x_desc, w_desc, out_desc, rows, cols2, K: tl.constexpr, ACT: tl.constexpr,
    PERSISTENT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    STAGES: tl.constexpr,
):  # fmt: skip
    """Grid: (NUM_PROGRAMS,) persistent programs, or one per output tile when not PERSISTENT
    (Triton's interpreter cannot loop to a bound read from a run-time argument). K, the
    model's hidden size, is a compile-time constant: a model has one."""
    num_m = tl.cdiv(rows, BM)
    num_n = tl.cdiv(cols2, BN)
    if PERSISTENT:
        for tile in tl.range(
            tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=True, num_stages=STAGES
        ):
            _gated_linear_tile(
                tile, x_desc, w_desc, out_desc, num_m, num_n, K, ACT, PRECISION, BM, BN, BK,
                GROUP_M,
            )  # fmt: skip
    else:
        _gated_linear_tile(
            tl.program_id(0), x_desc, w_desc, out_desc, num_m, num_n, K, ACT, PRECISION, BM,
            BN, BK, GROUP_M,
        )  # fmt: skip


def _aligned(t: torch.Tensor) -> bool:
    """A TMA descriptor's needs: 16-byte base and row stride, contiguous last dimension."""
    return (
        t.stride(-1) == 1
        and t.stride(0) >= t.shape[1]  # rows apart (a TMA descriptor takes no stride 0)
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
    )


def tma_compatible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether (T, K) rows ``x`` and a (2 I, K) ``weight`` meet ``gated_linear``'s TMA
    descriptors' needs, its (T, I) output's included: 16-byte aligned rows that do not
    overlap, contiguous last dimensions, a contiguous weight, I a multiple of 16 bytes."""
    out_row_bytes = weight.shape[0] // 2 * weight.element_size()
    return _aligned(x) and _aligned(weight) and weight.is_contiguous() and out_row_bytes % 16 == 0


def gated_linear(x: torch.Tensor, weight: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """act(x G^T) * (x U^T) in one Triton GEMM, G and U interleaved in ``weight``.

    Args:
        x: (T, K) rows, float32, float16 or bfloat16; last dimension contiguous, base and row
            stride 16-byte aligned (K a multiple of 16 bytes).
        weight: (2 I, K) in x's dtype and on its device, rows interleaved
            (``xgr.layers.linear.interleave_gate_up``), contiguous; I a multiple of 16 bytes.
        act: "silu" (SwiGLU) or "gelu_tanh" (GeGLU with the tanh approximation).

    Returns:
        (T, I) in x's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or alignments as above, or another activation.
    """
    if act not in GATE_ACTIVATIONS:
        raise ValueError(f"act must be one of {list(GATE_ACTIVATIONS)}, got {act!r}")
    if x.dim() != 2 or x.dtype not in LAUNCH:
        raise ValueError(f"x must be (T, K) of {list(LAUNCH)}, got {tuple(x.shape)} {x.dtype}")
    rows, depth = x.shape
    if (
        weight.dim() != 2
        or weight.shape[1] != depth
        or weight.shape[0] % 2
        or weight.dtype != x.dtype
        or weight.device != x.device
    ):
        raise ValueError(f"weight must be (2 I, {depth}) {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")  # fmt: skip
    cols = weight.shape[0] // 2
    out = torch.empty(rows, cols, dtype=x.dtype, device=x.device)
    if not rows or not cols or not depth:
        return out.zero_() if rows and cols else out
    if not tma_compatible(x, weight):
        raise ValueError("x, weight and the (T, I) output need 16-byte aligned rows and a "
                         "contiguous last dimension (TMA descriptors)")  # fmt: skip
    bm, bn, bk, stages, warps = LAUNCH[x.dtype]
    tiles = triton.cdiv(rows, bm) * triton.cdiv(2 * cols, bn)
    persistent = x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    programs = min(tiles, multiprocessor_count(x.device)) if persistent else tiles
    _gated_linear_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(weight, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn // 2]),
        rows, 2 * cols, K=depth, ACT=GATE_ACTIVATIONS[act], PERSISTENT=persistent,
        NUM_PROGRAMS=programs if persistent else 1,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BM=bm, BN=bn, BK=bk, GROUP_M=8, STAGES=stages, num_warps=warps,
    )  # fmt: skip
    return out


def gated_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, act: str = "silu"
) -> torch.Tensor:
    """The torch ops ``gated_linear`` replaces: act(gate) * up of F.linear(x, weight), its
    interleaved columns split, each step rounded to x's dtype. Shapes as ``gated_linear``."""
    projected = F.linear(x, weight)
    return TORCH_ACTIVATIONS[act](projected[:, 0::2]) * projected[:, 1::2]
