"""The HTTP server under the API: uvicorn with read timeouts and a connection limit.

uvicorn itself waits for a request's headers and body for ever and accepts connections until
the process runs out of file descriptors. Here its HTTP protocols (h11, and httptools when
installed) close a connection whose headers do not arrive within ``header_timeout``, answer
408 to a body that does not arrive within ``body_timeout`` of its headers, and keep at most
``max_connections`` open. At start the file-descriptor soft limit is raised to the hard
limit, and ``accept()`` failures are logged at most once a second.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import math
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from xgr.core import XgrError, positive_int

logger = logging.getLogger(__name__)

# File descriptors kept free of connections: the model's files, the CUDA driver, logging,
# the listening socket (on top of those open when the server starts).
FD_HEADROOM = 128
# uvicorn's listen backlog. asyncio accepts up to this many connections per loop turn (and
# libuv all that are queued), and an accepted connection beyond the limit holds its
# descriptor for about three turns before its refusal closes it: descriptors for a few
# such bursts are kept free on top of the connections.
DEFAULT_BACKLOG = 2048
ACCEPT_BURSTS = 4
# accept() errors that mean "out of descriptors or memory": the listening socket stays
# readable, so without a limit the loop reports them thousands of times a second.
ACCEPT_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# Most bytes a request's line and headers may take (then 431 and the connection is closed):
# a client could otherwise fill the memory within the header timeout. Real clients send a
# few KiB; nginx's default buffers hold 4 x 8 KiB.
MAX_HEADER_BYTES = 64 * 1024


@dataclass(frozen=True)
class HttpConfig:
    """Connection limits of the HTTP server (seconds, connections), validated once.

    Attributes:
        header_timeout: a connection must send a request's complete headers within this
            long of opening (or, kept alive, of the request's first byte); else it is
            closed without an answer.
        body_timeout: a request's body must arrive within this long of its headers; else
            the answer is 408 ``{"error": ...}`` and the connection is closed.
        keep_alive_timeout: an idle kept-alive connection is closed after this long
            (uvicorn's ``timeout_keep_alive``).
        max_connections: connections open at once. One more closes the connection that
            has waited longest with no request in progress (idle between requests, or
            still sending its headers); when every connection has a request in progress,
            the new one is answered 503 ``{"error": ...}`` with ``Connection: close`` and
            closed before its request is read (so its client may see a reset instead).
            Lowered at start to what the file-descriptor limit allows.
        access_log: log a line per request (uvicorn's access log). Off by default: under
            load its formatting and writing cost the event loop about as much as a refusal.
    """

    header_timeout: float = 10.0
    body_timeout: float = 10.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 8192
    access_log: bool = False

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise XgrError(f"HttpConfig.{name} must be a number of seconds, got {value!r}")
            if not (math.isfinite(value) and value > 0):
                raise XgrError(f"HttpConfig.{name} must be finite and > 0 s, got {value!r}")
            object.__setattr__(self, name, float(value))
        limit = positive_int("HttpConfig.max_connections", self.max_connections)
        object.__setattr__(self, "max_connections", limit)


def _json_response(status: int, reason: str, error: str, extra: bytes = b"") -> bytes:
    """A complete HTTP/1.1 response with the API's error body, closing the connection."""
    body = json.dumps({"error": error}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    ).encode()
    return head + extra + b"\r\n" + body


class _Deadlines:
    """Timers and the connection limit shared by the h11 and httptools protocols.

    Listed before uvicorn's protocol class, it admits the connection in ``connection_made``
    and forgets it in ``connection_lost``; subclasses call ``_request_started``,
    ``_headers_done`` and ``_body_done`` as the request is parsed and ``_idle`` once a
    response is sent. ``protocol_class`` sets ``settings``,
    ``max_connections`` and ``waiting`` (one server's connections with no request in
    progress, longest waiting first).
    """

    settings: HttpConfig = HttpConfig()
    max_connections: int = HttpConfig.max_connections
    waiting: dict[_Deadlines, None] = {}
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _refused = False
    _header_bytes = 0
    _header_tail = b""  # the last bytes counted: a header end may span two reads

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._opened()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed()
        super().connection_lost(exc)  # type: ignore[misc]

    def _opened(self) -> bool:
        """Admit the connection (True: its header clock runs), closing the longest-waiting
        idle one when over the limit, or refuse it (False) when none is idle."""
        if len(self.connections) > self.max_connections:  # this one is already counted
            idle = next(iter(self.waiting), None)
            if idle is None:
                self._refused = True
                self._uncount()
                self.transport.write(self._refusal())
                self.transport.close()
                return False
            # A slow or idle client gives way: a flood of them cannot lock others out.
            idle._uncount()
            idle.transport.close()
        self.waiting[self] = None
        self._request_started()
        return True

    def _count_header_bytes(self, data: bytes) -> bool:
        """Count the bytes of a request's line and headers as they arrive (a read may also
        hold the start of its body, which is not counted); False (the connection answered
        431 and closed) once they exceed ``MAX_HEADER_BYTES``."""
        if self._header_timer is None:
            return True
        seen = self._header_tail + data
        end = seen.find(b"\r\n\r\n")
        if end < 0:
            self._header_bytes += len(data)
            self._header_tail = seen[-3:]
        else:
            self._header_bytes += max(0, end + 4 - len(self._header_tail))
            self._header_tail = b""
        if self._header_bytes <= MAX_HEADER_BYTES:
            return True
        self._refused = True
        error = f"request headers exceed {MAX_HEADER_BYTES} bytes"
        self.transport.write(_json_response(431, "Request Header Fields Too Large", error))
        self.transport.close()
        return False

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP/1.1, as the API's JSON error."""
        self.transport.write(_json_response(400, "Bad Request", f"invalid HTTP request: {msg}"))
        self.transport.close()

    def _uncount(self) -> None:
        # Closing takes a loop turn: uncounted now, so that connections arriving meanwhile
        # are not refused (or others closed) for it.
        self.connections.discard(self)
        self.waiting.pop(self, None)

    def _idle(self) -> None:
        if not self.transport.is_closing():
            self.waiting[self] = None

    def _refusal(self) -> bytes:
        error = f"too many connections: this server holds at most {self.max_connections}"
        return _json_response(503, "Service Unavailable", error, b"retry-after: 1\r\n")

    def _request_started(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(
                self.settings.header_timeout, self._header_timed_out
            )

    def _headers_done(self) -> None:
        self._header_bytes = 0
        self._header_tail = b""
        self.waiting.pop(self, None)
        self._cancel("_header_timer")
        if self._body_timer is None:
            self._body_timer = self.loop.call_later(
                self.settings.body_timeout, self._body_timed_out
            )

    def _body_done(self) -> None:
        self._cancel("_body_timer")

    def _closed(self) -> None:
        self.waiting.pop(self, None)
        self._cancel("_header_timer")
        self._cancel("_body_timer")

    def _cancel(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        # Answer only when the late request is the one being served and has no answer
        # started; otherwise bytes written now would land inside another response.
        if cycle is not None and not cycle.response_started and self._serving(cycle):
            seconds = f"{self.settings.body_timeout:g}"
            error = f"request body not received within {seconds} s of its headers"
            self.transport.write(_json_response(408, "Request Timeout", error))
        if cycle is not None:
            cycle.disconnected = True  # the app's receive() returns http.disconnect
            cycle.message_event.set()
        self.transport.close()

    def _serving(self, cycle: Any) -> bool:
        return True


class TimedH11Protocol(_Deadlines, H11Protocol):
    """uvicorn's h11 protocol with header and body timeouts and the connection limit."""

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self.conn.their_state is h11.IDLE:  # the first bytes of the next request
            self._request_started()
        if self._count_header_bytes(data):
            super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        # h11's state says where the request is: IDLE before its headers are complete,
        # SEND_BODY while its body is read, DONE (or an error) once it is all in.
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            self._headers_done()
        elif state is not h11.IDLE:
            self.waiting.pop(self, None)
            self._cancel("_header_timer")
            self._body_done()

    def on_response_complete(self) -> None:
        self._idle()  # before a pipelined request, which the call may start, is parsed
        super().on_response_complete()


def _httptools_protocol() -> type[asyncio.Protocol] | None:
    """The httptools protocol with the same timeouts, or None without httptools."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class TimedHttpToolsProtocol(_Deadlines, HttpToolsProtocol):
        """uvicorn's httptools protocol with header and body timeouts and the limit."""

        def data_received(self, data: bytes) -> None:
            if not self._refused and self._count_header_bytes(data):
                super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._request_started()

        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._headers_done()

        def on_message_complete(self) -> None:
            self._body_done()
            super().on_message_complete()

        def on_response_complete(self) -> None:
            if not self.pipeline:  # else the call starts the next, already parsed, request
                self._idle()
            super().on_response_complete()

        def _serving(self, cycle: Any) -> bool:
            # A pipelined request waits in self.pipeline while an earlier one is answered.
            return all(queued is not cycle for queued, _ in self.pipeline)

    return TimedHttpToolsProtocol


def protocol_class(
    settings: HttpConfig, max_connections: int | None = None, http: str = "auto"
) -> type[asyncio.Protocol]:
    """The uvicorn HTTP protocol class enforcing ``settings``.

    Args:
        settings: the timeouts and the connection limit.
        max_connections: the limit actually enforced (default ``settings.max_connections``).
        http: "auto" (httptools when installed, as uvicorn chooses), "httptools" or "h11".

    Raises:
        XgrError: "httptools" without httptools installed, or another ``http``.
    """
    if http not in ("auto", "httptools", "h11"):
        raise XgrError(f"http must be 'auto', 'httptools' or 'h11', got {http!r}")
    base = None if http == "h11" else _httptools_protocol()
    if base is None and http == "httptools":
        raise XgrError("http='httptools' needs the httptools package")
    base = base or TimedH11Protocol
    limit = settings.max_connections if max_connections is None else max_connections
    attributes = {"settings": settings, "max_connections": limit, "waiting": {}}
    return type(base.__name__, (base,), attributes)


def raise_fd_limit() -> int | None:
    """Raise the file-descriptor soft limit (RLIMIT_NOFILE) to the hard limit and log it.

    Returns:
        the soft limit now in force (None: unlimited).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # An unlimited hard limit (macOS) cannot be the soft one: try large finite values.
    wanted = [hard] if hard != resource.RLIM_INFINITY else [1 << 20, 10240]
    for target in wanted:
        if soft != resource.RLIM_INFINITY and soft >= target:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            logger.warning("cannot raise the file-descriptor limit to %d: %s", target, exc)
            continue
        logger.info("file-descriptor limit raised from %d to %d", soft, target)
        soft = target
        break
    return None if soft == resource.RLIM_INFINITY else soft


def _open_fds() -> int:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return len(os.listdir(folder))
        except OSError:
            continue
    return 0


def connection_limit(settings: HttpConfig, fd_limit: int | None) -> tuple[int, int]:
    """The connection limit and listen backlog that fit under ``fd_limit`` descriptors.

    The connections, ``ACCEPT_BURSTS`` backlogs of connections being accepted or refused,
    and ``FD_HEADROOM`` more descriptors than are open now stay under ``fd_limit``, so that
    accept() does not run out of descriptors because of connections. The backlog is
    ``DEFAULT_BACKLOG``, smaller under a low ``fd_limit``; ``settings.max_connections`` is
    lowered, with a warning, when it does not fit.

    Returns:
        (max connections, backlog).
    """
    if fd_limit is None:
        return settings.max_connections, DEFAULT_BACKLOG
    budget = fd_limit - _open_fds() - FD_HEADROOM
    backlog = min(DEFAULT_BACKLOG, max(16, budget // 16))
    room = max(1, budget - ACCEPT_BURSTS * backlog)
    if settings.max_connections <= room:
        return settings.max_connections, backlog
    logger.warning(
        "max connections lowered from %d to %d: the file-descriptor limit is %d",
        settings.max_connections,
        room,
        fd_limit,
    )
    return room, backlog


def _is_accept_error(context: dict[str, Any]) -> bool:
    exc = context.get("exception")
    message = str(context.get("message", ""))
    # asyncio schedules a retry of accept() (_start_serving) for every failure: those still
    # pending when the server closes fail too, on the closed socket.
    if "accept" in message or "_start_serving" in message:
        return True
    return isinstance(exc, OSError) and exc.errno in ACCEPT_ERRNOS


class AcceptErrorLog:
    """An event-loop exception handler logging ``accept()`` failures at most once per
    ``interval`` seconds, with the number of failures since the last message; every other
    error goes to ``fallback`` (default: the loop's default handler).

    asyncio reports a failed accept() for every connection it tries while descriptors are
    short: thousands of tracebacks a second that drown the log and the loop.
    """

    def __init__(
        self,
        interval: float = 1.0,
        fallback: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval = interval
        self.fallback = fallback
        self.clock = clock
        self.failures = 0  # since the last message
        self.last_error: BaseException | str | None = None
        self._quiet_until = -math.inf
        self._report: asyncio.TimerHandle | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not _is_accept_error(context):
            if self.fallback is not None:
                self.fallback(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self.failures += 1
        self.last_error = context.get("exception") or context.get("message")
        if self._report is not None:
            return
        wait = self._quiet_until - self.clock()
        if wait <= 0:
            self.report()
        else:
            self._report = loop.call_later(wait, self.report)

    def report(self) -> None:
        """Log the failures counted since the last message (if any)."""
        self._report = None
        if not self.failures:
            return
        logger.error(
            "accept() failed %d time(s) in the last %g s: %s",
            self.failures,
            self.interval,
            self.last_error,
        )
        self.failures = 0
        self._quiet_until = self.clock() + self.interval


class Server(uvicorn.Server):
    """uvicorn's server with ``AcceptErrorLog`` on its event loop (asyncio or uvloop)."""

    async def serve(self, sockets: list[Any] | None = None) -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(AcceptErrorLog(fallback=loop.get_exception_handler()))
        await super().serve(sockets)


def make_server(
    app: Any,
    host: str,
    port: int,
    settings: HttpConfig | None = None,
    max_connections: int | None = None,
    **options: Any,
) -> Server:
    """A server for ``app`` on ``host``:``port`` enforcing ``settings``.

    Args:
        app: the ASGI app.
        host, port: where to listen.
        settings: timeouts and connection limit (default ``HttpConfig()``).
        max_connections: the limit enforced (default ``settings.max_connections``).
        options: more ``uvicorn.Config`` arguments (``log_level``, ``backlog``, ``http``:
            "auto", "httptools" or "h11").
    """
    settings = settings or HttpConfig()
    http = protocol_class(settings, max_connections, options.pop("http", "auto"))
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=http,
        timeout_keep_alive=settings.keep_alive_timeout,
        ws="none",  # no WebSocket routes: an Upgrade request is served as plain HTTP
        access_log=settings.access_log,
        **options,
    )
    return Server(config)


def run_server(app: Any, host: str, port: int, settings: HttpConfig | None = None) -> None:
    """Serve ``app`` until SIGINT/SIGTERM: raise the file-descriptor limit, fit the
    connection limit under it, then run uvicorn with ``settings``.

    Raises:
        SystemExit: the server could not start (as ``uvicorn.run``).
    """
    settings = settings or HttpConfig()
    limit, backlog = connection_limit(settings, raise_fd_limit())
    server = make_server(app, host, port, settings, limit, backlog=backlog)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    if not server.started:
        raise SystemExit(3)  # uvicorn's STARTUP_FAILURE
