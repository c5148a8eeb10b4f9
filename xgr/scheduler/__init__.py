"""Request scheduling: batches by token budget, size and deadlines; serving metrics."""

from xgr.scheduler.batcher import (
    Answer,
    DeadlineExceededError,
    LatencyModel,
    QueuedRequest,
    QueueFullError,
    RequestBatcher,
    ShuttingDownError,
    http_status,
)
from xgr.scheduler.metrics import ServingMetrics

__all__ = [
    "Answer",
    "DeadlineExceededError",
    "LatencyModel",
    "QueueFullError",
    "QueuedRequest",
    "RequestBatcher",
    "ServingMetrics",
    "ShuttingDownError",
    "http_status",
]
