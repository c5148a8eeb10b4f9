"""Request scheduling: batches by token budget, size and deadlines; serving metrics."""

from xgr.scheduler.batcher import RequestBatcher
from xgr.scheduler.metrics import ServingMetrics
from xgr.scheduler.requests import (
    Answer,
    DeadlineExceededError,
    LatencyModel,
    QueuedRequest,
    QueueFullError,
    SchedulerFailedError,
    ShuttingDownError,
    http_status,
)

__all__ = [
    "Answer",
    "DeadlineExceededError",
    "LatencyModel",
    "QueueFullError",
    "QueuedRequest",
    "RequestBatcher",
    "SchedulerFailedError",
    "ServingMetrics",
    "ShuttingDownError",
    "http_status",
]
