"""Server settings and the request-body size limit."""

from __future__ import annotations

from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from xgr.core import XgrError, positive_int
from xgr.scheduler.requests import check_max_batch_ms
from xgr.server.schemas import MAX_BEAM_WIDTH


@dataclass(frozen=True)
class ServerConfig:
    """Limits and defaults of one server, validated once.

    Attributes:
        max_beam_width: largest beam width a request may ask for.
        default_beam_width: beam width of completions that name none.
        max_batch_size: most requests per engine call.
        max_body_bytes: largest request body accepted (larger: 413).
        max_batch_tokens: most scheduled tokens (prompt + beam width x levels) per call.
        max_queue: most requests waiting for a batch (more: 429).
        streams: CUDA streams the engine runs batches on side by side (its
            ``cuda_streams``); each also queues a launched batch behind its running one.
        max_batch_ms: longest predicted run time of a batch of several requests (ms; None:
            no limit), so requests arriving meanwhile wait at most about that long for it.
        admin_token: the bearer token of the catalog admin API (``/v1/catalog``); None
            leaves the API off.
        max_catalog_body_bytes: largest body of a catalog update (a whole index JSON).
    """

    max_beam_width: int = 512
    default_beam_width: int = 64
    max_batch_size: int = 32
    max_body_bytes: int = 1 << 20
    max_batch_tokens: int = 1 << 20
    max_queue: int = 4096
    streams: int = 1
    max_batch_ms: float | None = None
    admin_token: str | None = None
    max_catalog_body_bytes: int = 1 << 28

    def __post_init__(self) -> None:
        names = ("max_beam_width", "default_beam_width", "max_batch_size", "max_body_bytes")
        for name in (*names, "max_batch_tokens", "max_queue", "streams", "max_catalog_body_bytes"):
            object.__setattr__(
                self, name, positive_int(f"ServerConfig.{name}", getattr(self, name))
            )
        check_max_batch_ms(self.max_batch_ms)
        if self.max_beam_width > MAX_BEAM_WIDTH:  # the request schema's own bound
            raise XgrError(
                f"ServerConfig.max_beam_width {self.max_beam_width} exceeds the API's "
                f"limit of {MAX_BEAM_WIDTH}"
            )
        if self.default_beam_width > self.max_beam_width:
            raise XgrError("ServerConfig.default_beam_width exceeds max_beam_width")
        token = self.admin_token
        if token is not None and (
            not isinstance(token, str)
            or len(token) < 16
            or not (token.isascii() and token.isprintable())
            or " " in token
        ):
            raise XgrError(
                "the admin token must be at least 16 printable ASCII characters without spaces"
            )


class BodySizeLimit:
    """ASGI middleware answering 413 to bodies over ``max_bytes``, declared or streamed.

    The body is read here (at most ``max_bytes``) and replayed to the app, so an oversized
    chunked body is refused before any route sees it.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, paths: dict[str, int] | None = None) -> None:
        """``paths``: path -> its own limit (the catalog admin API's larger one)."""
        self.app = app
        self.max_bytes = max_bytes
        self.paths = paths or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.paths.get(scope.get("path", ""), self.max_bytes)
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(send, limit)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._too_large(send, limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, limit: int) -> None:
        body = f'{{"error": "request body exceeds {limit} bytes"}}'.encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 413, "headers": headers})
        await send({"type": "http.response.body", "body": body})
