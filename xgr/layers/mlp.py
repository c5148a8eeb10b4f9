"""The gated feed-forward block of Qwen and Llama models: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from xgr.layers.linear import concat_linears

_ACTIVATIONS = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class GatedMLP(nn.Module):
    """(T, hidden) -> (T, hidden); parameter names follow the HF checkpoints."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = _ACTIVATIONS[act]

        self.silu = act == "silu"
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one ``gate_up_proj`` (rows concatenated). Idempotent."""
        if self.gate_up_proj is None:
            self.gate_up_proj = concat_linears(self.gate_proj, self.up_proj)
            del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:  # one GEMM; gate and up are column views
            gate, up = self.gate_up_proj(x).chunk(2, dim=1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        if self.silu and x.is_cuda:  # one Triton pass instead of two kernels
            from xgr.kernels.triton_elementwise import silu_mul

            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(self.act(gate) * up)
