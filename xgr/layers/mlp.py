"""The gated feed-forward block of Qwen and Llama models: down(act(gate(x)) * up(x))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if self.silu and x.is_cuda:  # one Triton pass instead of two kernels
            from xgr.kernels.triton_elementwise import silu_mul

            return self.down_proj(silu_mul(gate, up))
        return self.down_proj(self.act(gate) * up)
