"""Rotary position embedding (Su et al., "RoFormer", 2021), half-split ("rotate_half") layout."""

from __future__ import annotations

import torch


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines of each position's rotation angles.

    Args:
        positions: (T,) int64 token positions.
        head_dim: rotated dimension (even).
        theta: RoPE base frequency.
        dtype: dtype of the returned tables (angles are computed in float32).

    Returns:
        cos, sin: (T, head_dim) each, the frequency table repeated for both halves.
    """
    exponents = (
        torch.arange(0, head_dim, 2, dtype=torch.float32, device=positions.device) / head_dim
    )
    inv_freq = 1.0 / (theta**exponents)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (T, heads, head_dim) ``x`` by the (T, head_dim) tables of ``rope_cos_sin``.

    On CUDA one Triton pass (``xgr.kernels.triton_elementwise``), else the reference.
    """
    if x.is_cuda and x.shape[-1] in (16, 32, 64, 128, 256):
        from xgr.kernels import triton_elementwise

        return triton_elementwise.apply_rope(x, cos, sin)
    return apply_rope_reference(x, cos, sin)


def apply_rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The torch reference of ``apply_rope``: x * cos + rotate_half(x) * sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
