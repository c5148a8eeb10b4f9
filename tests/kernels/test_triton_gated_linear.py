"""The gate/up GEMM with the gated activation in its epilogue against the torch ops it replaces.

On the CPU under Triton's interpreter (float32 and float16: its ``tl.dot`` of bfloat16
operands is wrong); on a GPU compiled, with bfloat16 too, where it also runs its persistent
grid.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from xgr.kernels.triton_gated_linear import gated_linear, gated_linear_reference  # noqa: E402
from xgr.layers.linear import interleave_gate_up  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# float32: summation order only; half types: one rounding step of the output at most.
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}

# (rows, K, I): tails in every dimension; several row blocks; a tile-multiple shape.
CASES = [(1, 64, 64), (70, 96, 200), (130, 64, 136), (128, 128, 128)]


def inputs(rows, depth, inter, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, depth, generator=gen) * 2
    gate_then_up = torch.randn(2 * inter, depth, generator=gen) / depth**0.5
    return x.to(DEVICE, dtype), gate_then_up.to(DEVICE, dtype)


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "depth", "inter"), CASES, ids=str)
def test_kernel_equals_the_torch_ops(rows, depth, inter, dtype, act):
    x, w = inputs(rows, depth, inter, dtype, seed=rows + depth + inter)
    interleaved = interleave_gate_up(w)
    got = gated_linear(x, interleaved, act)
    expected = gated_linear_reference(x, interleaved, act)
    assert got.shape == expected.shape == (rows, inter) and got.dtype == dtype
    assert torch.isfinite(got).all()
    err = (got.float() - expected.float()).abs().max() / expected.float().abs().max()
    assert err <= TOLERANCE[dtype], err
    # The reference on interleaved rows is the gated feed-forward on the original weight.
    gate, up = F.linear(x.float(), w.float()).chunk(2, dim=1)
    act_gate = F.silu(gate) if act == "silu" else F.gelu(gate, approximate="tanh")
    atol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(expected.float(), act_gate * up, atol=atol, rtol=2e-2)


def test_interleave_gate_up_alternates_rows():
    w = torch.arange(8.0).reshape(4, 2)  # gate rows 0-1, up rows 2-3
    assert interleave_gate_up(w).tolist() == [[0, 1], [4, 5], [2, 3], [6, 7]]
    assert interleave_gate_up(torch.arange(4.0)).tolist() == [0, 2, 1, 3]
    with pytest.raises(ValueError, match="gate-then-up"):
        interleave_gate_up(torch.zeros(3, 2))


def test_empty_rows_and_bad_arguments():
    x, w = inputs(4, 64, 32, torch.float32, seed=0)
    assert gated_linear(x[:0], w).shape == (0, 32)
    with pytest.raises(ValueError, match="act must be"):
        gated_linear(x, w, "relu")
    with pytest.raises(ValueError, match="weight must be"):
        gated_linear(x, w[:, :-1])
    with pytest.raises(ValueError, match="weight must be"):
        gated_linear(x, w[:-1])
    with pytest.raises(ValueError, match="weight must be"):
        gated_linear(x, w.double())
    with pytest.raises(ValueError, match="x must be"):
        gated_linear(x.double(), w.double())
    with pytest.raises(ValueError, match="aligned"):
        gated_linear(x[:, 1:], w[:, 1:].contiguous())  # a row stride of 63 floats
    with pytest.raises(ValueError, match="aligned"):
        gated_linear(x[:1].expand(4, 64), w)  # rows on top of each other
