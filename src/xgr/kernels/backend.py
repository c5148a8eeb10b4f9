"""Which decode-attention implementation a device runs, chosen once and logged."""

from __future__ import annotations

import logging

import torch

from xgr.core import XgrError
from xgr.kernels.decode_attention_launch import SUPPORTED_HEAD_DIMS

logger = logging.getLogger(__name__)


def select_attention_backend(device: torch.device, head_dim: int) -> str:
    """The decode-attention backend for ``device``, chosen once and logged.

    Returns:
        "triton" on CUDA devices, "torch" (the reference) elsewhere.

    Raises:
        XgrError: a CUDA device without Triton installed, or a head_dim the kernel lacks.
    """
    if device.type != "cuda":
        backend = "torch"
    else:
        try:
            import triton  # noqa: F401
        except ImportError as exc:
            raise XgrError(f"device {device} needs Triton for decode attention: {exc}") from exc
        if head_dim not in SUPPORTED_HEAD_DIMS:
            raise XgrError(
                f"head_dim {head_dim} is not supported by the GPU decode kernel "
                f"({SUPPORTED_HEAD_DIMS}); serve this model on the CPU"
            )
        backend = "triton"
    logger.info("decode attention backend: %s (device %s)", backend, device)
    return backend
