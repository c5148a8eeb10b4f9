"""Which decode-attention implementation a device runs, and the device fact the kernels size
their grids by (its multiprocessor count)."""

from __future__ import annotations

import functools
import logging

import torch

from xgr.core import XgrError

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
            from xgr.kernels.triton_decode_attention import SUPPORTED_HEAD_DIMS
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


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one for an index-less
    ``cuda``), read from the driver once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessor_count(index)


@functools.cache
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
