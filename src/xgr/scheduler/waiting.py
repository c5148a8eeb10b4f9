"""The requests waiting for a batch: kept by identity, with their scheduled tokens and
their places in the queue."""

from __future__ import annotations

from collections.abc import Callable

from xgr.scheduler.batch_policy import live_requests, queue_orders
from xgr.scheduler.requests import QueuedRequest


class WaitingQueue:
    """Requests admitted and not yet taken into a batch.

    Requests are kept by identity (their prompts may be NumPy arrays, whose equality has no
    truth value), so adding, withdrawing and counting cost O(1); ``in_order`` sorts by the
    places ``batch_policy.queue_orders`` hands out.

    Args:
        cost: a request's scheduled tokens.
        max_batch_size, max_batch_tokens: the batch limits a group's share per round uses.
    """

    def __init__(
        self, cost: Callable[[QueuedRequest], int], max_batch_size: int, max_batch_tokens: int
    ) -> None:
        self.cost = cost
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self._requests: dict[int, QueuedRequest] = {}  # insertion order: admission order
        self.tokens = 0  # scheduled tokens of the waiting requests
        self.rounds = 0  # batches taken so far
        self._admitted = 0

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, requests: list[QueuedRequest], costs: list[int]) -> None:
        """Queue requests admitted together (``costs``: their scheduled tokens), each given
        its place."""
        orders = queue_orders(
            costs, self.rounds, self._admitted, self.max_batch_size, self.max_batch_tokens
        )
        self._admitted += len(requests)
        for request, cost, order in zip(requests, costs, orders, strict=True):
            request.order = order
            self._requests[id(request)] = request
            self.tokens += cost

    def withdraw(self, request: QueuedRequest) -> bool:
        """Take one request out; False if it was not waiting."""
        if self._requests.pop(id(request), None) is None:
            return False
        self.tokens -= self.cost(request)
        return True

    def take_all(self) -> list[QueuedRequest]:
        """Empty the queue, returning what it held."""
        taken = list(self._requests.values())
        self._requests, self.tokens = {}, 0
        return taken

    def in_order(self, now: float) -> list[QueuedRequest]:
        """The requests still to serve, in queue order; withdrawn ones leave, and those whose
        deadline passed at ``now`` are answered 504 and leave (``live_requests``)."""
        kept = live_requests(sorted(self._requests.values(), key=_place), now)
        if len(kept) != len(self._requests):
            self._requests = {id(r): r for r in kept}
            self.tokens = sum(map(self.cost, kept))
        return kept

    def take(self, batch: list[QueuedRequest]) -> None:
        """Take a batch's requests out as it starts (one round more)."""
        for request in batch:
            self.withdraw(request)
        self.rounds += 1


def _place(request: QueuedRequest) -> tuple[int, int]:
    return request.order
