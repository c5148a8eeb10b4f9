"""Fusing linear layers that read the same input into one GEMM."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def concat_linears(*linears: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` computing all of ``linears`` at once: their output rows stacked.

    Its output's column blocks, in argument order, equal each layer's output (split it with
    ``Tensor.split``). Weights and biases are copied; the caller drops the originals.

    Raises:
        ValueError: layers with different input sizes, dtypes, devices or bias presence.
    """
    first = linears[0].weight
    if any(
        lin.weight.shape[1] != first.shape[1]
        or lin.weight.dtype != first.dtype
        or lin.weight.device != first.device
        or (lin.bias is None) != (linears[0].bias is None)
        for lin in linears
    ):
        raise ValueError("only linears of one input size, dtype, device and bias can be fused")
    # Built on the meta device: a real one would draw its random initialization from the
    # default generator (wasted work, and it moves the generator's state under the caller).
    fused = nn.Linear(
        first.shape[1], sum(lin.weight.shape[0] for lin in linears),
        bias=linears[0].bias is not None, device="meta", dtype=first.dtype,
    )  # fmt: skip
    fused.weight = nn.Parameter(torch.cat([lin.weight for lin in linears]), requires_grad=False)
    if linears[0].bias is not None:
        fused.bias = nn.Parameter(torch.cat([lin.bias for lin in linears]), requires_grad=False)
    return fused
