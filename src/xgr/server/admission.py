"""Admission before the body: a request the scheduler cannot take is refused in microseconds.

Under overload most requests are refused; if each refusal first paid for reading, parsing and
validating its body and resolving its history, the event loop would spend the time that the
admitted requests (and the engine thread, which shares the interpreter) need, and the answers
per second would collapse far below the capacity. This ASGI middleware asks the scheduler
(``RequestBatcher.check_admission``: queue room, a failed or stopping loop) before the
application sees the request, and answers the refusal itself. The deadline, which is in the
body, is checked again once the body is parsed, before the history is resolved.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from xgr.core import XgrError
from xgr.scheduler import QueueFullError, RequestBatcher, http_status


class AdmissionGate:
    """ASGI middleware refusing ``POST`` requests to ``paths`` that the scheduler would
    refuse now (429 with Retry-After, 503), with the JSON error body, without reading their
    bodies.

    Args:
        app: the application.
        batcher: the scheduler the requests would be queued in.
        paths: the routes that queue work.
    """

    def __init__(self, app: ASGIApp, batcher: RequestBatcher, paths: frozenset[str]) -> None:
        self.app = app
        self.batcher = batcher
        self.paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in self.paths:
            try:
                self.batcher.check_admission()
            except XgrError as exc:
                await send_refusal(send, exc)
                return
        await self.app(scope, receive, send)


async def send_refusal(send: Send, exc: XgrError) -> None:
    """Answer a scheduler's refusal as the error handlers do: ``{"error": message}`` with its
    status, and Retry-After (s) for a full queue."""
    body = json.dumps({"error": str(exc)}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if isinstance(exc, QueueFullError):
        headers.append((b"retry-after", str(exc.retry_after).encode()))
    await send({"type": "http.response.start", "status": http_status(exc), "headers": headers})
    await send({"type": "http.response.body", "body": body})
