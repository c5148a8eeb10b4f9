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

from starlette.responses import JSONResponse
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
                await error_response(exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def error_response(exc: XgrError, status: int | None = None) -> JSONResponse:
    """The API's answer to a refusal: ``{"error": message}`` with its status (``http_status``
    unless given), and Retry-After (s) for a full queue."""
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, QueueFullError) else None
    status = http_status(exc) if status is None else status
    return JSONResponse(status_code=status, content={"error": str(exc)}, headers=headers)
