"""The small-rows projection kernel (norm, activation, gating and residual fused in) against
the torch ops it replaces.

On the CPU under Triton's interpreter (float32; it truncates to bfloat16, so half types
there would not round as torch does); on a GPU compiled, bf16 and fp16 too.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels.triton_small_rows_linear import (  # noqa: E402
    MAX_ROWS,
    small_rows_linear,
    small_rows_linear_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
# float32: summation order only; half types: a rounding step of the output at most.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

# (rows, K, N, norm, residual, activation, gated)
CASES = [
    (1, 64, 96, True, False, None, False),  # a q/k/v projection
    (5, 96, 64, False, True, None, False),  # an output projection
    (16, 128, 80, True, False, "gelu_tanh", True),  # T5 v1.1's gated feed-forward
    (3, 200, 50, True, False, "relu", False),  # T5's ReLU feed-forward; K not a tile multiple
    (8, 300, 64, True, False, "silu", True),  # SwiGLU
    (2, 64, 40, False, True, "relu", False),
    (4, 8, 24, True, True, "silu", True),  # K below the GPU's smallest tensor-core tile
]


def inputs(rows, depth, cols, norm, residual, gated, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen) * 3
    w = torch.randn(cols, depth, generator=gen) / depth**0.5
    g = 1 + torch.randn(depth, generator=gen) / 4 if norm else None
    out_cols = cols // 2 if gated else cols
    r = torch.randn(rows, out_cols, generator=gen) if residual else None
    return [None if t is None else t.to(dtype=dtype, device=DEVICE) for t in (x, w, g, r)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "depth", "cols", "norm", "residual", "act", "gated"), CASES)
def test_kernel_equals_the_torch_ops(rows, depth, cols, norm, residual, act, gated, dtype):
    x, w, g, r = inputs(rows, depth, cols, norm, residual, gated, dtype, seed=rows + depth)
    got = small_rows_linear(x, w, g, 1e-6, r, act, gated)
    expected = small_rows_linear_reference(x, w, g, 1e-6, r, act, gated)
    assert got.shape == expected.shape == (rows, cols // 2 if gated else cols)
    assert got.dtype == dtype and torch.isfinite(got).all()
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOLERANCE[dtype], err


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "depth", "cols", "norm", "residual", "act", "gated"), CASES)
def test_one_row_matrix_vector_path_equals_the_torch_ops(
    rows, depth, cols, norm, residual, act, gated, dtype
):
    # One row takes the FMA path (no tensor-core tile) with narrow column blocks.
    x, w, g, r = inputs(1, depth, cols, norm, residual, gated, dtype, seed=depth + cols)
    got = small_rows_linear(x, w, g, 1e-6, r, act, gated)
    expected = small_rows_linear_reference(x, w, g, 1e-6, r, act, gated)
    assert got.shape == expected.shape == (1, cols // 2 if gated else cols)
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOLERANCE[dtype], err


def test_one_row_launch_shapes_give_the_same_result():
    x, w, g, r = inputs(1, 300, 200, True, True, False, torch.float32, seed=5)
    expected = small_rows_linear_reference(x, w, g, 1e-5, r)
    for config in [(4, 64, 2, 2), (8, 256, 4, 3), (16, 128, 4, 3), (32, 512, 8, 2)]:
        got = small_rows_linear(x, w, g, 1e-5, r, config=config)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_every_launch_tile_shape_gives_the_same_result():
    x, w, g, r = inputs(7, 256, 192, True, True, False, torch.float32, seed=1)
    expected = small_rows_linear_reference(x, w, g, 1e-5, r)
    for config in [(16, 64, 4, 2), (32, 128, 4, 3), (64, 256, 8, 3)]:
        got = small_rows_linear(x, w, g, 1e-5, r, config=config)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


def test_no_rows_and_bad_arguments():
    x, w, *_ = inputs(3, 64, 32, False, False, False, torch.float32, seed=2)
    assert small_rows_linear(x[:0], w).shape == (0, 32)
    with pytest.raises(ValueError, match="at most"):
        small_rows_linear(torch.zeros(MAX_ROWS + 1, 64, device=DEVICE), w)
    with pytest.raises(ValueError, match="weight"):
        small_rows_linear(x, w[:, :63])
    with pytest.raises(ValueError, match="activation"):
        small_rows_linear(x, w, activation="tanh")
    with pytest.raises(ValueError, match="BLOCK_N 8"):  # tensor-core tiles need 16
        small_rows_linear(x, w, config=(8, 64, 4, 2))
    with pytest.raises(ValueError, match="activation"):
        small_rows_linear(x, w, gated=True)  # gating needs an activation
    with pytest.raises(ValueError, match="residual"):
        small_rows_linear(x, w, residual=torch.zeros(3, 31, device=DEVICE))
    with pytest.raises(ValueError, match="norm_weight"):
        small_rows_linear(x, w, norm_weight=torch.ones(63, device=DEVICE))
    with pytest.raises(ValueError, match="float32/float16/bfloat16"):
        small_rows_linear(x.double(), w.double())
    with pytest.raises(ValueError, match=r"\(M, K\)"):
        small_rows_linear(x[0], w)
    with pytest.raises(ValueError, match="column"):
        small_rows_linear(x[:, :0], w[:, :0])
