"""The device fact the kernels size their grids by: a CUDA device's multiprocessor count."""

from __future__ import annotations

import functools

import torch


def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one for an index-less
    ``cuda``), read from the driver once per device."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessor_count(index)


@functools.cache
def _multiprocessor_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
