"""RMSNorm (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, then scaled in the input dtype (as HF does).

    Args:
        x: (..., dim) any float dtype. weight: (dim,). eps: added to the mean square.

    Returns:
        Same shape and dtype as x.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm as Qwen and Llama checkpoints expect; one Triton pass on CUDA.

    Input (..., dim) of any float dtype; output the same shape and dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with ``residual``, (x + residual, norm(x + residual)) in one pass on CUDA."""
        if x.is_cuda:
            from xgr.kernels.triton_elementwise import rms_norm

            return rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm_reference(x, self.weight, self.eps)
        total = x + residual
        return total, rms_norm_reference(total, self.weight, self.eps)
