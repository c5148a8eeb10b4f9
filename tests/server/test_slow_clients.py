"""Slow and idle clients against a real server on 127.0.0.1: header and body timeouts, the
keep-alive timeout, the connection limit, the file-descriptor limit, accept() errors."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import wait_until_ready
from xgr.core import XgrError
from xgr.server.app import create_app
from xgr.server.http import (
    AcceptErrorLog,
    HttpConfig,
    connection_limit,
    make_server,
    protocol_class,
)

PROTOCOLS = [
    "h11",
    pytest.param(
        "httptools",
        marks=pytest.mark.skipif(
            protocol_class(HttpConfig()).__name__ != "TimedHttpToolsProtocol",
            reason="httptools is not installed",
        ),
    ),
]
SHORT = HttpConfig(header_timeout=0.5, body_timeout=0.5, keep_alive_timeout=0.5)


@contextlib.contextmanager
def serving(app, settings: HttpConfig, http: str) -> Iterator[tuple[str, int]]:
    """``app`` served by ``make_server`` on a free 127.0.0.1 port in a thread; yields the
    base URL and the port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = make_server(app, "127.0.0.1", port, settings, http=http, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    try:
        assert wait_until_ready(url, 60), "the test server did not become ready"
        yield url, port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def connect(port: int, payload: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if payload:
        sock.sendall(payload)
    return sock


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (a reset counts as closed);
    fails when it is still open after ``timeout`` seconds."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        pytest.fail(f"still open after {timeout} s; received {received!r}")
    return received


def read_response(sock: socket.socket, timeout: float = 5) -> tuple[bytes, bytes]:
    """One response (its status line and headers, its body) read from a kept-alive
    connection; its body's length is the content-length header."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(4096) or pytest.fail(f"closed after {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
        if line.startswith(b"content-length:")
    )  # fmt: skip
    while len(body) < length:
        body += sock.recv(4096) or pytest.fail(f"closed after {data + body!r}")
    return head, body


def json_error(response: bytes, status: int) -> str:
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), response
    assert b"connection: close" in head.lower()
    return json.loads(body)["error"]


HEADERS = b"POST /v1/recommend HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
HALF_SENT = {
    "nothing": b"",
    "part of the headers": HEADERS,
    "headers and {": HEADERS + b"content-length: 30\r\n\r\n{",
}


@pytest.mark.parametrize("http", PROTOCOLS)
def test_half_sent_requests_are_closed_while_health_answers(engine, http):
    with serving(create_app(engine), SHORT, http) as (url, port):
        opened = time.monotonic()
        held = {kind: [connect(port, p) for _ in range(100)] for kind, p in HALF_SENT.items()}
        try:
            with httpx.Client(base_url=url, timeout=1) as client:
                started = time.monotonic()
                assert client.get("/health").json() == {"status": "ok"}
                assert time.monotonic() - started < 1
            for kind, socks in held.items():
                for sock in socks:
                    answer = read_until_closed(sock, timeout=3)
                    if kind == "headers and {":
                        assert "body not received within 0.5 s" in json_error(answer, 408)
                    else:
                        assert answer == b"", kind
            # Closed by the timeouts (0.5 s), not by this test's 3 s patience.
            assert time.monotonic() - opened < 2.5
            with httpx.Client(base_url=url, timeout=1) as client:
                assert client.get("/health").status_code == 200
        finally:
            for sock in (s for socks in held.values() for s in socks):
                sock.close()


@pytest.mark.parametrize("http", PROTOCOLS)
def test_kept_alive_connections_are_timed_too(engine, http):
    request = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    with serving(create_app(engine), SHORT, http) as (_, port):
        with connect(port, request) as idle, connect(port, request) as slow:
            for sock in (idle, slow):
                assert read_response(sock)[0].startswith(b"HTTP/1.1 200 ")
            slow.sendall(b"GET /health HTTP/1.1\r\n")  # the next request, never finished
            started = time.monotonic()
            assert read_until_closed(idle, timeout=3) == b""  # the keep-alive timeout
            assert read_until_closed(slow, timeout=3) == b""  # the header timeout
            assert time.monotonic() - started < 1.5
        with connect(port, request) as fast:  # a request sent in pieces in time is served
            assert read_response(fast)[0].startswith(b"HTTP/1.1 200 ")
            fast.sendall(HEADERS)
            time.sleep(0.2)
            body = json.dumps({"history": ["item1"], "beam_width": 4, "num_results": 2})
            fast.sendall(f"content-length: {len(body)}\r\n\r\n".encode())
            time.sleep(0.2)
            fast.sendall(body.encode())
            head, answer = read_response(fast)
            assert head.startswith(b"HTTP/1.1 200 ") and json.loads(answer)["items"]


@pytest.mark.parametrize("http", PROTOCOLS)
def test_over_the_limit_an_idle_connection_gives_way(engine, http):
    settings = HttpConfig(header_timeout=3, max_connections=20)
    with serving(create_app(engine), settings, http) as (url, port):
        time.sleep(0.6)  # the readiness polls' connections closed
        idle = [connect(port, b"") for _ in range(20)]
        try:
            time.sleep(0.2)  # all accepted
            started = time.monotonic()
            assert httpx.get(f"{url}/health", timeout=1).status_code == 200
            assert time.monotonic() - started < 1
            # The one waiting longest (the first) was closed for it; the others wait on.
            assert read_until_closed(idle[0], timeout=1) == b""
            idle[1].settimeout(0.2)
            with pytest.raises(TimeoutError):
                idle[1].recv(1)
        finally:
            for sock in idle:
                sock.close()


@pytest.mark.parametrize("http", PROTOCOLS)
def test_over_the_limit_with_every_request_in_progress_a_503_at_once(engine, http):
    settings = HttpConfig(body_timeout=1.5, max_connections=20)
    with serving(create_app(engine), settings, http) as (url, port):
        time.sleep(0.6)  # the readiness polls' connections closed
        busy = [connect(port, HALF_SENT["headers and {"]) for _ in range(20)]
        try:
            time.sleep(0.2)  # all accepted, their bodies awaited
            refused = connect(port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            started = time.monotonic()
            answer = read_until_closed(refused, timeout=1)
            assert time.monotonic() - started < 0.5
            refused.close()
            # A 503, or nothing when the refusal's close overtook it (a reset).
            if answer:
                assert "too many connections" in json_error(answer, 503)
            # The requests in progress were left alone: they end at their body timeout.
            for sock in busy:
                assert "body not received" in json_error(read_until_closed(sock, 3), 408)
            assert httpx.get(f"{url}/health", timeout=1).status_code == 200
        finally:
            for sock in busy:
                sock.close()


def test_settings_are_checked():
    for bad in ({"header_timeout": 0}, {"body_timeout": float("inf")}, {"max_connections": 0}):
        with pytest.raises(XgrError, match=next(iter(bad))):
            HttpConfig(**bad)
    with pytest.raises(XgrError, match="keep_alive_timeout must be a number"):
        HttpConfig(keep_alive_timeout="5")
    assert HttpConfig(header_timeout=1).header_timeout == 1.0


def test_serve_refuses_bad_http_options(served_model_dir):
    from click.testing import CliRunner

    from xgr.cli import main

    model = str(served_model_dir)
    for option, value, message in [
        ("--header-timeout", "0", "header_timeout must be finite and > 0"),
        ("--body-timeout", "-1", "body_timeout must be finite and > 0"),
        ("--max-connections", "0", "--max-connections"),
    ]:
        result = CliRunner().invoke(main, ["serve", "--model", model, option, value])
        assert result.exit_code != 0 and message in result.output, result.output


def test_the_fd_soft_limit_is_raised_to_the_hard_limit():
    script = textwrap.dedent(
        """
        import logging, resource
        from xgr.server.http import raise_fd_limit
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(256, hard), hard))
        print(raise_fd_limit(), *resource.getrlimit(resource.RLIMIT_NOFILE))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    returned, soft, hard = (int(v) for v in done.stdout.split())
    if hard < 1 << 30:  # a finite hard limit: reached
        assert returned == soft == hard
        if hard > 256:
            assert f"file-descriptor limit raised from 256 to {hard}" in done.stderr


def test_max_connections_fit_under_the_fd_limit(caplog):
    settings = HttpConfig(max_connections=1_000_000)
    with caplog.at_level(logging.WARNING, logger="xgr.server.http"):
        assert connection_limit(settings, None) == (1_000_000, 2048)
        lowered, backlog = connection_limit(settings, 4096)
    # The connections and a few backlogs of them being accepted fit.
    assert 16 <= backlog < 2048 and 1 <= lowered <= 4096 - 128 - 4 * backlog
    assert "max connections lowered from 1000000" in caplog.text
    assert connection_limit(HttpConfig(max_connections=100), 1 << 20) == (100, 2048)


def test_accept_errors_are_logged_at_most_once_per_interval(caplog):
    other = []

    async def flood() -> None:
        loop = asyncio.get_running_loop()
        log = AcceptErrorLog(interval=0.2, fallback=lambda _, context: other.append(context))
        loop.set_exception_handler(log)
        emfile = OSError(errno.EMFILE, "Too many open files")
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:  # as asyncio reports them: thousands a second
            for _ in range(100):
                loop.call_exception_handler(
                    {"message": "socket.accept() out of system resource", "exception": emfile}
                )
            await asyncio.sleep(0.001)
        loop.call_exception_handler({"message": "something else"})
        await asyncio.sleep(0.3)  # the last interval's count is reported too

    with caplog.at_level(logging.ERROR, logger="xgr.server.http"):
        asyncio.run(flood())
    messages = [r.getMessage() for r in caplog.records if r.name == "xgr.server.http"]
    assert 2 <= len(messages) <= 5, messages  # 0.5 s at one per 0.2 s, and the last count
    assert all("accept() failed" in m and "Too many open files" in m for m in messages)
    counted = sum(int(m.split("failed ")[1].split()[0]) for m in messages)
    assert counted >= 1000  # every failure counted once
    assert other == [{"message": "something else"}]


def test_a_server_out_of_descriptors_logs_accept_errors_once_a_second():
    # In a child whose descriptor limit leaves room for a few connections only.
    script = textwrap.dedent(
        """
        import os, resource, sys
        from fastapi import FastAPI
        from xgr.server.http import HttpConfig, make_server

        app = FastAPI()

        @app.get("/health")
        def health():
            return {"status": "ok"}

        port = int(sys.argv[1])
        server = make_server(app, "127.0.0.1", port, HttpConfig(header_timeout=5),
                             max_connections=100_000, http="h11", loop="asyncio")
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 30, hard))
        server.run()
        """
    )
    if not sys.platform.startswith("linux"):
        pytest.skip("counts descriptors in /proc")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    child = subprocess.Popen(
        [sys.executable, "-c", script, str(port)], stderr=subprocess.PIPE, text=True
    )
    held = []
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the child server did not start"
                time.sleep(0.1)
        held = [connect(port, b"") for _ in range(200)]  # more than its descriptors
        time.sleep(2.5)
        for sock in held:
            sock.close()
        time.sleep(1.5)  # asyncio retries accept() a second after a failure
        assert httpx.get(f"{url}/health", timeout=2).status_code == 200
    finally:
        child.terminate()
        _, stderr = child.communicate(timeout=30)
        for sock in held:
            sock.close()
    reports = [line for line in stderr.splitlines() if "accept() failed" in line]
    # About 5 s of failures, from the flood to the shutdown: thousands, in a few lines.
    assert 1 <= len(reports) <= 8, stderr[-2000:]
    assert sum(int(line.split("failed ")[1].split()[0]) for line in reports) > 1000
    assert "Traceback" not in stderr, stderr[-2000:]


@pytest.mark.parametrize("http", PROTOCOLS)
def test_oversized_headers_and_malformed_http_get_json_errors(engine, http):
    with serving(create_app(engine), SHORT, http) as (url, port):
        huge = connect(port, b"GET /health HTTP/1.1\r\nhost: x\r\n")
        try:
            for i in range(40):  # 2.6 MB of headers, more than any limit lets through
                huge.sendall(b"x-%d: " % i + b"a" * 65000 + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed while still sending
        answered = read_until_closed(huge, 5)
        if answered:  # 431 here; h11 may refuse first by its own bound, with a 400
            status = 400 if answered.startswith(b"HTTP/1.1 400") and http == "h11" else 431
            assert json_error(answered, status)
        garbage = connect(port, b"POST /v1/recommend HTTP/1.1\r\ncontent-length: abc\r\n\r\n")
        assert "invalid HTTP request" in json_error(read_until_closed(garbage, 5), 400)
        upgrade = httpx.get(
            f"{url}/health", headers={"upgrade": "websocket", "connection": "upgrade"}
        )
        slash = httpx.post(f"{url}/v1/recommend/", json={"history": ["x"]})
    assert answered or http == "h11"  # httptools: the 431 arrives before the close
    assert upgrade.status_code == 200 and upgrade.json() == {"status": "ok"}
    assert slash.status_code == 404 and "error" in slash.json()


def test_serve_refuses_a_model_that_cannot_hold_one_item(tmp_path, served_model_dir):
    import shutil

    from click.testing import CliRunner

    from xgr.cli import main

    folder = tmp_path / "model"
    shutil.copytree(served_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 3}))
    result = CliRunner().invoke(main, ["serve", "--model", str(folder), "--port", "1"])
    assert result.exit_code != 0 and "a prompt of one item needs" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("http", PROTOCOLS)
def test_a_large_body_sent_at_once_is_not_counted_as_headers(engine, http):
    """A request whose headers and a large body reach the server in one read (a fast client
    on a fast link) is answered, not refused as oversized headers."""
    body = b'{"history": ["item3"], "beam_width": 8, "num_results": 2}' + b" " * 300_000
    head = HEADERS + b"content-length: %d\r\n\r\n" % len(body)
    with serving(create_app(engine), SHORT, http) as (_, port):
        for split in (len(head), len(head) - 2, len(head) - 3):  # the header end split too
            sock = connect(port, head[:split])
            sock.sendall(head[split:] + body)
            response, answer = read_response(sock, 30)
            sock.close()
            assert response.startswith(b"HTTP/1.1 200 "), (split, response, answer[:200])
            assert json.loads(answer)["items"]
