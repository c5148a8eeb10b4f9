"""``xgr.Client`` against servers that do not answer as xgr does: a ServerError, no crash."""

from __future__ import annotations

import json

import httpx
import pytest

from xgr import Client
from xgr.client import ServerError
from xgr.core import XgrError


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
        (
            422,
            b'{"error": "bad", "detail": [{"loc": null, "msg": "m"}]}',
            "application/json",
            "bad",
        ),
        (422, b'{"error": "bad", "detail": [{"loc": "x", "msg": "m"}]}', "application/json", "bad"),
        (
            200,
            b'{"items": [{"item_id": "1", "score": null, "semantic_id": "<a_1>"}], '
            b'"timings": {"prefill_ms": 1, "decode_ms": 1}}',
            "application/json",
            "did not answer as an xgr server",
        ),
    ],
)
def test_unexpected_answers_raise_server_errors(status, content, content_type, message):
    with client_answering(status, content, content_type) as client:
        with pytest.raises(ServerError, match=message) as caught:
            client.recommend([1, 2])
    assert caught.value.status == status


def test_422_names_the_refused_fields():
    detail = [{"loc": ["body", "beam_width"], "msg": "too big"}]
    body = json.dumps({"error": "invalid request body", "detail": detail}).encode()
    with client_answering(422, body, "application/json") as client:
        with pytest.raises(ServerError, match=r"invalid request body \(body.beam_width: too big\)"):
            client.recommend([1])


def test_bad_arguments_fail_before_sending():
    sent = []
    client = Client("http://stub.invalid")
    client._http.close()
    client._http = httpx.Client(
        base_url="http://stub.invalid",
        transport=httpx.MockTransport(lambda request: sent.append(request) or httpx.Response(500)),
    )
    with client:
        with pytest.raises(XgrError, match="got the string '12'"):
            client.recommend("12")
        with pytest.raises(XgrError, match="cannot be sent as JSON"):
            client.recommend([1], deadline_ms=float("nan"))
    assert sent == []


def refusing_stub() -> tuple[Client, list]:
    """A client whose server records each JSON body and answers 400 "stop"."""
    bodies = []

    def answer(request):
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": "stop"})

    client = Client("http://stub.invalid")
    client._http.close()
    client._http = httpx.Client(
        base_url="http://stub.invalid", transport=httpx.MockTransport(answer)
    )
    return client, bodies


def test_numpy_item_ids_are_sent_as_numbers():
    import numpy as np

    client, bodies = refusing_stub()
    with client, pytest.raises(ServerError, match="stop"):
        client.recommend(
            np.array([3, 4]), beam_width=np.int64(8), num_results=np.int32(2),
            item_filter={"price": {"lt": np.int64(30)}, "tag": {"in": (np.str_("a"), "b")}},
        )  # fmt: skip
    assert bodies[0]["history"] == [3, 4]
    assert (bodies[0]["beam_width"], bodies[0]["num_results"]) == (8, 2)
    assert bodies[0]["filter"] == {"price": {"lt": 30}, "tag": {"in": ["a", "b"]}}


@pytest.mark.parametrize("timeout", [-1, 0, float("nan"), float("inf"), "5", True])
def test_a_bad_timeout_is_refused_when_the_client_is_made(timeout):
    with pytest.raises(XgrError, match="timeout must be"):
        Client("http://127.0.0.1:1", timeout=timeout)


def test_url_scheme_in_capitals_and_spaces_are_accepted():
    with Client(" HTTP://127.0.0.1:1 ", timeout=0.5) as client:
        assert str(client._http.base_url) == "http://127.0.0.1:1"


def test_a_404_under_a_url_path_says_so():
    client = Client("http://stub.invalid/v1")
    client._http.close()
    client._http = httpx.Client(
        base_url="http://stub.invalid/v1",
        transport=httpx.MockTransport(lambda request: httpx.Response(404, text="Not Found")),
    )
    with client, pytest.raises(ServerError, match="the server URL has a path, '/v1/'"):
        client.recommend([1])


def test_completions_and_chat_send_numpy_values_and_refuse_bad_offsets():
    import numpy as np

    from xgr.client import encode_span

    client, bodies = refusing_stub()
    rows = np.zeros((1, 4), np.float32)
    with client:
        with pytest.raises(ServerError, match="stop"):
            client.complete([1, 2], n=np.int64(2), prompt_embeds=[(np.int64(1), rows)])
        with pytest.raises(ServerError, match="stop"):
            client.chat([{"role": "user", "content": "hi"}], n=np.int32(3))
        for offset in (1.7, True, "1"):
            with pytest.raises(XgrError, match="offset must be an int"):
                client.complete([1, 2], prompt_embeds=[(offset, rows)])
    assert bodies[0]["n"] == 2 and bodies[0]["prompt_embeds"][0]["offset"] == 1
    assert bodies[1]["n"] == 3
    assert encode_span(0, rows)["shape"] == [1, 4]
