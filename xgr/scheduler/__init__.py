"""Request scheduling: the batching queue and serving metrics."""

from xgr.scheduler.batcher import Answer, DeadlineExceededError, QueuedRequest, RequestBatcher
from xgr.scheduler.metrics import ServingMetrics

__all__ = ["Answer", "DeadlineExceededError", "QueuedRequest", "RequestBatcher", "ServingMetrics"]
