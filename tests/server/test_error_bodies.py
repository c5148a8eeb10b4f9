"""Every error answer is the documented JSON body: text no UTF-8 can hold (400), and an
unexpected exception in a route (500), on a real server's kept-alive connections."""

from __future__ import annotations

import json
import logging
import socket
from urllib.parse import urlsplit

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.conftest import live_server
from xgr.core import XgrError
from xgr.server.app import create_app

# JSON's escape for a lone surrogate: valid JSON, but no UTF-8 text holds the code point.
SURROGATE = "\\ud800"


def exchange(sock: socket.socket, path: str, body: bytes) -> tuple[int, dict, bytes]:
    """POST ``body`` (JSON text) on ``sock``; the answer's status, headers and body."""
    sock.sendall(
        f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536) or pytest.fail(f"closed after {data!r}")
    head, _, content = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(content) < int(headers["content-length"]):
        content += sock.recv(65536) or pytest.fail("closed in the body")
    return int(status_line.split()[1]), headers, content


def connect(base_url: str) -> socket.socket:
    url = urlsplit(base_url)
    return socket.create_connection((url.hostname, url.port), timeout=30)


def test_a_lone_surrogate_is_refused_by_the_engine(engine):
    with pytest.raises(XgrError, match=r"'\\ud800' at character 5 of the prompt is a lone"):
        engine.token_ids("<a_1>\ud800")


@pytest.mark.parametrize(
    ("path", "body", "error"),
    [
        (
            "/v1/completions",
            f'{{"prompt": "{SURROGATE}"}}',
            r"invalid text: '\ud800' at character 0 of the prompt is a lone surrogate",
        ),
        (
            "/v1/completions",
            f'{{"prompt": ["<a_1> <b_2>", "<a_1> {SURROGATE}"], "beam_width": 4}}',
            r"prompt 1: invalid text: '\ud800' at character 6 of the prompt",
        ),
        ("/v1/recommend", f'{{"history": ["{SURROGATE}"]}}', r"unknown items in history"),
    ],
    ids=["one prompt", "a list of prompts", "a history"],
)
def test_a_lone_surrogate_is_a_400_and_the_connection_serves_on(base_url, path, body, error):
    with connect(base_url) as sock:
        status, headers, content = exchange(sock, path, body.encode())
        assert status == 400 and headers["content-type"] == "application/json"
        assert error in json.loads(content)["error"]
        assert "connection" not in headers
        # The same connection answers the next request.
        ok = json.dumps({"prompt": "<a_1> <b_2> <c_3>", "beam_width": 4}).encode()
        status, _, content = exchange(sock, "/v1/completions", ok)
        assert status == 200 and json.loads(content)["choices"]


class BrokenEngine:
    """The engine, except that tokenizing fails with an error that is not an XgrError."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def token_ids(self, prompt):
        raise RuntimeError("the tokenizer broke")


def test_an_unexpected_error_is_a_json_500(engine, caplog):
    app = create_app(BrokenEngine(engine))
    body = {"history": ["item1"], "beam_width": 4, "num_results": 2}
    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.post("/v1/recommend", json=body)
        assert answer.status_code == 500
        assert answer.json() == {"error": "internal error: RuntimeError"}
        assert answer.headers["connection"] == "close"
        assert client.get("/health").status_code == 200


def test_an_unexpected_error_on_a_kept_alive_connection(engine, caplog):
    server_log = logging.getLogger("uvicorn.error")
    body = {"history": ["item1"], "beam_width": 4, "num_results": 2}
    try:
        with live_server(create_app(BrokenEngine(engine))) as url:
            # Once uvicorn has set up its loggers, which do not propagate to the root.
            server_log.addHandler(caplog.handler)
            with httpx.Client(base_url=url, timeout=30) as client:
                assert client.get("/health").status_code == 200  # the connection is open
                answer = client.post("/v1/recommend", json=body)
                assert answer.status_code == 500
                assert answer.json() == {"error": "internal error: RuntimeError"}
                # Said beforehand: the client leaves the connection, and its next request
                # goes on a new one.
                assert answer.headers["connection"] == "close"
                assert client.get("/health").json() == {"status": "ok"}
            with connect(url) as sock:
                status, headers, content = exchange(
                    sock, "/v1/recommend", json.dumps(body).encode()
                )
                assert status == 500 and headers["connection"] == "close"
                assert json.loads(content) == {"error": "internal error: RuntimeError"}
                sock.settimeout(5)
                assert sock.recv(1) == b""  # closed as announced
    finally:
        server_log.removeHandler(caplog.handler)
    tracebacks = [r for r in caplog.records if r.exc_info and r.name == "uvicorn.error"]
    assert tracebacks and "the tokenizer broke" in str(tracebacks[0].exc_info[1])
