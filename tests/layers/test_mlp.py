"""The gated feed-forward after ``fuse_projections``: one interleaved gate/up weight, and on
CUDA the gate/up GEMM with the activation in its epilogue from ``GATED_LINEAR_MIN_ROWS``."""

from __future__ import annotations

import pytest
import torch

from xgr.layers.linear import fuse_gate_up
from xgr.layers.mlp import GATED_LINEAR_MIN_ROWS, GatedMLP

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pair(act: str, bias: bool, dtype: torch.dtype) -> tuple[GatedMLP, GatedMLP]:
    torch.manual_seed(0)
    plain = GatedMLP(64, 96, act, bias).to(DEVICE, dtype)
    fused = GatedMLP(64, 96, act, bias).to(DEVICE, dtype)
    fused.load_state_dict(plain.state_dict())
    fused.fuse_projections()
    fused.fuse_projections()  # idempotent
    return plain, fused


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh", "relu"])
def test_fused_projections_equal_the_hf_layout(act, bias):
    plain, fused = pair(act, bias, torch.float32)
    assert not hasattr(fused, "gate_proj") and fused.gate_up_proj.weight.shape == (192, 64)
    x = torch.randn(37, 64, device=DEVICE)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), rtol=1e-5, atol=1e-5)


def test_fuse_gate_up_refuses_mismatched_layers():
    with pytest.raises(ValueError, match="one output size"):
        fuse_gate_up(torch.nn.Linear(8, 4), torch.nn.Linear(8, 6))


@pytest.mark.skipif(DEVICE != "cuda", reason="the fused-epilogue GEMM runs on CUDA")
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [GATED_LINEAR_MIN_ROWS - 1, GATED_LINEAR_MIN_ROWS + 300])
def test_cuda_paths_by_row_count(rows, act, monkeypatch):
    from xgr.kernels import triton_gated_linear

    calls = []
    real = triton_gated_linear.gated_linear
    monkeypatch.setattr(triton_gated_linear, "gated_linear", lambda *a: calls.append(1) or real(*a))
    plain, fused = pair(act, False, torch.bfloat16)
    x = torch.randn(rows, 64, device=DEVICE, dtype=torch.bfloat16)
    with torch.no_grad():
        got, want = fused(x), plain(x)
    assert len(calls) == (rows >= GATED_LINEAR_MIN_ROWS)
    err = (got.float() - want.float()).abs().max() / want.float().abs().max()
    assert err < 2e-2, err
