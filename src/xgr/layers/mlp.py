"""The gated feed-forward block of Qwen and Llama models: down(act(gate(x)) * up(x)), and the
gated projection it shares with T5 v1.1's feed-forward."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from xgr.layers.linear import fuse_gate_up

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
# The activations the CUDA kernels apply (``xgr.kernels.triton_gated_linear``,
# ``triton_elementwise.gated_mul_interleaved``), by HF's config names.
KERNEL_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh"}
# Rows from which CUDA runs the gate/up GEMM with the activation in its epilogue
# (``xgr.kernels.triton_gated_linear``). Below it (a single request's decode levels)
# cuBLAS + the activation pass is faster; from it the fused kernel is about as fast or
# faster per call, and whole prefills gained at every length measured (docs/performance.md).
GATED_LINEAR_MIN_ROWS = 1024


def gated_projection(
    x: torch.Tensor, gate_up: nn.Linear, act: Callable, kernel_act: str | None
) -> torch.Tensor:
    """act(gate) * up of a gate/up projection whose rows interleave them (``fuse_gate_up``).

    On CUDA with ``kernel_act`` ("silu" or "gelu_tanh", the same function as ``act``):
    from ``GATED_LINEAR_MIN_ROWS`` rows of a half dtype, with no bias and the layouts its TMA
    descriptors take (``tma_compatible``), one Triton GEMM with the activation in its
    epilogue; otherwise cuBLAS and one elementwise pass. Elsewhere (or kernel_act
    None) the torch ops.

    Args:
        x: (T, K) rows in the layer's dtype.
        gate_up: the fused ``nn.Linear`` of ``fuse_gate_up``, (2 I, K) weight.
        act: the activation as a torch function (the reference path).
        kernel_act: its kernels' name, or None where no kernel applies it.

    Returns:
        (T, I) in x's dtype.
    """
    if kernel_act is None or not x.is_cuda or x.dim() != 2:
        projected = gate_up(x)
        return act(projected[..., 0::2]) * projected[..., 1::2]
    from xgr.kernels.triton_gated_linear import gated_linear, tma_compatible

    if (
        x.shape[0] >= GATED_LINEAR_MIN_ROWS
        and x.dtype in (torch.bfloat16, torch.float16)
        and gate_up.bias is None
        and tma_compatible(x, gate_up.weight)
    ):
        return gated_linear(x, gate_up.weight, kernel_act)
    from xgr.kernels.triton_elementwise import gated_mul_interleaved

    return gated_mul_interleaved(gate_up(x), kernel_act)


class GatedMLP(nn.Module):
    """(T, hidden) -> (T, hidden); parameter names follow the HF checkpoints."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]
        self.kernel_act = KERNEL_ACTIVATIONS.get(act)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one ``gate_up_proj`` whose output rows interleave
        them (``xgr.layers.linear.fuse_gate_up``), the layout the fused kernels read.
        Idempotent."""
        if self.gate_up_proj is None:
            self.gate_up_proj = fuse_gate_up(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is None:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(gated_projection(x, self.gate_up_proj, self.act, self.kernel_act))
