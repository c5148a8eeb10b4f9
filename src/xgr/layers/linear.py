"""Fusing linear layers that read the same input into one GEMM."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def concat_linears(*linears: nn.Linear, interleave: bool = False) -> nn.Linear:
    """One ``nn.Linear`` computing all of ``linears`` at once: their output rows stacked, or,
    ``interleave``, taken in turn (row i of each layer, then row i + 1 of each, ...).

    Stacked, its output's column blocks, in argument order, equal each layer's output (split
    it with ``Tensor.split``); interleaved, column n * i + j is layer j's column i. Weights
    and biases are copied once; the caller drops the originals.

    Raises:
        ValueError: layers with different input sizes, dtypes, devices or bias presence, or,
            interleaved, different output sizes.
    """
    first = linears[0].weight
    if any(
        lin.weight.shape[1] != first.shape[1]
        or lin.weight.dtype != first.dtype
        or lin.weight.device != first.device
        or (lin.bias is None) != (linears[0].bias is None)
        or (interleave and lin.weight.shape[0] != first.shape[0])
        for lin in linears
    ):
        raise ValueError(
            "only linears of one input size, dtype, device and bias (and, interleaved, one "
            "output size) can be fused"
        )

    def join(tensors: list[torch.Tensor]) -> torch.Tensor:
        return _interleave_rows(tensors) if interleave else torch.cat(tensors)

    # Built on the meta device: a real one would draw its random initialization from the
    # default generator (wasted work, and it moves the generator's state under the caller).
    fused = nn.Linear(
        first.shape[1], sum(lin.weight.shape[0] for lin in linears),
        bias=linears[0].bias is not None, device="meta", dtype=first.dtype,
    )  # fmt: skip
    fused.weight = nn.Parameter(join([lin.weight for lin in linears]), requires_grad=False)
    if linears[0].bias is not None:
        fused.bias = nn.Parameter(join([lin.bias for lin in linears]), requires_grad=False)
    return fused


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """The rows of a [gate; up] weight (or bias) interleaved: gate 0, up 0, gate 1, up 1, ...

    Args:
        weight: (2 I, K) or (2 I,): the gate rows, then the up rows.

    Returns:
        a new tensor of the same shape and dtype, row 2 i gate i, row 2 i + 1 up i.

    Raises:
        ValueError: an odd number of rows.
    """
    if weight.dim() not in (1, 2) or weight.shape[0] % 2:
        raise ValueError(f"need (2 I, K) or (2 I,) gate-then-up rows, got {tuple(weight.shape)}")
    return _interleave_rows(weight.chunk(2, dim=0))


def _interleave_rows(tensors) -> torch.Tensor:
    """Equally shaped tensors' rows taken in turn: row 0 of each, then row 1 of each, ...
    (the one definition of the interleaved layout, for weights, biases and fused linears)."""
    return torch.stack(tensors, dim=1).flatten(0, 1)


def fuse_gate_up(gate: nn.Linear, up: nn.Linear) -> nn.Linear:
    """One ``nn.Linear`` computing a gated feed-forward's gate and up projections at once,
    its output rows (weight and bias) interleaved, as ``interleave_gate_up`` lays them out:
    column 2 i of its output is gate i, column 2 i + 1 up i. Raises ValueError as
    ``concat_linears`` (interleaved)."""
    return concat_linears(gate, up, interleave=True)
