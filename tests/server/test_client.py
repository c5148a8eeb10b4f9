"""``xgr.Client`` against servers that do not answer as xgr does: a ServerError, no crash."""

from __future__ import annotations

import httpx
import pytest

from xgr import Client
from xgr.client import ServerError


def client_answering(status: int, content: bytes, content_type: str) -> Client:
    client = Client("http://stub.invalid")
    client._http.close()
    client._http = httpx.Client(
        base_url="http://stub.invalid",
        transport=httpx.MockTransport(
            lambda request: httpx.Response(
                status, content=content, headers={"content-type": content_type}
            )
        ),
    )
    return client


@pytest.mark.parametrize(
    ("status", "content", "content_type", "message"),
    [
        (200, b"<html>hello</html>", "text/html", "not JSON"),
        (200, b"[1, 2]", "application/json", "no JSON object"),
        (200, b'{"items": []}', "application/json", "did not answer as an xgr server"),
        (200, b'{"items": [{"score": 1}]}', "application/json", "did not answer as an xgr"),
        (500, b"[1, 2]", "application/json", "[1, 2]"),
        (503, b"busy", "text/plain", "busy"),
        (400, b'{"error": "bad history"}', "application/json", "bad history"),
    ],
)
def test_unexpected_answers_raise_server_errors(status, content, content_type, message):
    with client_answering(status, content, content_type) as client:
        with pytest.raises(ServerError, match=message) as caught:
            client.recommend([1, 2])
    assert caught.value.status == status
