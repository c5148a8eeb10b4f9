"""Prompts with input embeddings over HTTP (``prompt_embeds`` of /v1/completions and
/v1/recommend), chat messages through the folder's chat template (/v1/chat/completions),
their errors, and the Python client's three forms against a running server."""

from __future__ import annotations

import base64
import shutil

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from tests.conftest import live_server
from xgr import Client, Engine, Prompt
from xgr.client import ServerError, encode_span
from xgr.server.app import create_app
from xgr.server.config import ServerConfig

HIDDEN = 64
TEMPLATE = (
    "{% for m in messages %}{{ '<t1> ' if m['role'] == 'system' else '' }}"
    "{{ m['content'] }} {% endfor %}"
)


@pytest.fixture(scope="module")
def chat_dir(served_model_dir, tmp_path_factory):
    """The served folder with a chat template."""
    path = tmp_path_factory.mktemp("chat") / "model"
    shutil.copytree(served_model_dir, path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def chat_engine(chat_dir):
    return Engine.from_pretrained(chat_dir)


@pytest.fixture(scope="module")
def client(chat_engine):
    config = ServerConfig(max_body_bytes=2 * 1024 * 1024)
    with TestClient(create_app(chat_engine, config)) as client:
        yield client


def rows(n, seed, dtype=torch.float32):
    return (torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def codes_of(engine, results):
    return [engine.catalog.format_semantic_id(codes) for codes, _ in results.semantic_ids]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_completion_spans_equal_the_engine(client, chat_engine, dtype):
    ids = [1, 8 + 3, 8 + 16 + 4, 8 + 32 + 5, 2, 3]
    spans = [(1, rows(2, 1, dtype)), (4, rows(1, 2, dtype))]
    body = {"prompt": ids, "n": 4, "beam_width": 16}
    answer = client.post(
        "/v1/completions", json={**body, "prompt_embeds": [encode_span(*s) for s in spans]}
    )
    assert answer.status_code == 200, answer.text
    (want,) = chat_engine.recommend([Prompt(ids, spans)], 16, 16, 4)
    assert [c["text"] for c in answer.json()["choices"]] == codes_of(chat_engine, want)
    plain = client.post("/v1/completions", json=body).json()["choices"]
    assert [c["text"] for c in plain] != codes_of(chat_engine, want)  # the spans count
    whole = rows(5, 3, dtype)
    only = client.post(
        "/v1/completions", json={"n": 4, "beam_width": 16, "prompt_embeds": [encode_span(0, whole)]}
    )
    assert only.status_code == 200, only.text
    (want,) = chat_engine.recommend([Prompt(embeds=whole)], 16, 16, 4)
    assert [c["text"] for c in only.json()["choices"]] == codes_of(chat_engine, want)
    assert only.json()["usage"]["prompt_tokens"] == 5


def test_recommend_spans_cover_the_history_prompt(client, chat_engine):
    history = ["item3", "item9"]
    prompt = chat_engine.token_ids(chat_engine.history_prompt(history))
    spans = [(len(prompt) - 3, rows(3, 4))]  # the last item's codes
    body = {"history": history, "beam_width": 16, "num_results": 4,
            "prompt_embeds": [encode_span(*s) for s in spans]}  # fmt: skip
    answer = client.post("/v1/recommend", json=body)
    assert answer.status_code == 200, answer.text
    (want,) = chat_engine.recommend([Prompt(prompt, spans)], 16, 16, 4, exclude_item_ids=[history])
    assert [i["item_id"] for i in answer.json()["items"]] == [r.item_id for r in want.items]


def span(offset=0, shape=(1, HIDDEN), dtype="float32", data=None):
    if data is None:
        data = base64.b64encode(np.zeros(shape, np.float32).tobytes()).decode()
    return {"offset": offset, "shape": list(shape), "dtype": dtype, "data": data}


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"prompt": [1, 2], "prompt_embeds": [span(data="@@@")]}, 400, "not base64"),
        (
            {"prompt": [1, 2], "prompt_embeds": [{**span(), "shape": [2, HIDDEN]}]},
            400,
            "holds 256 bytes; shape [2, 64] of float32 needs 512",
        ),
        (
            {
                "prompt": [1, 2],
                "prompt_embeds": [span(shape=(1, 8), data=base64.b64encode(bytes(32)).decode())],
            },
            400,
            "(n, 64)",
        ),
        ({"prompt": [1, 2], "prompt_embeds": [span(offset=2)]}, 400, "outside the prompt"),
        ({"prompt": [1, 2, 3], "prompt_embeds": [span(0), span(0)]}, 400, "overlap"),
        (
            {
                "prompt": [1, 2],
                "prompt_embeds": [
                    span(data=base64.b64encode(np.full(64, np.nan, np.float32).tobytes()).decode())
                ],
            },
            400,
            "NaN",
        ),
        ({"prompt": [[1, 2], [3]], "prompt_embeds": [span()]}, 400, "one prompt, got 2"),
        ({"prompt_embeds": [span(offset=1)]}, 400, "one span at offset 0"),
        ({"n": 2}, 400, "needs a prompt, prompt_embeds"),
        ({"prompt": [1, 2], "prompt_embeds": [span()] * 1025}, 413, "at most 1024"),
        (
            {"prompt": [1, 2], "prompt_embeds": [span(shape=(10_000, HIDDEN), data="")]},
            413,
            "more than the model's",
        ),
        ({"prompt": [1, 2], "prompt_embeds": [span(shape=(0, HIDDEN))]}, 422, "shape"),
        ({"prompt": [1, 2], "prompt_embeds": [span(dtype="float64")]}, 422, "dtype"),
        ({"prompt": [1, 2], "prompt_embeds": [{**span(), "offset": -1}]}, 422, "offset"),
    ],
)
def test_bad_spans(client, body, status, fragment):
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == status, answer.text
    assert fragment in answer.text


def test_span_limits_and_history_truncation(client):
    big = np.zeros((4000, HIDDEN), np.float32)  # about 1.3 MB of base64 per copy
    body = {"prompt": [1, 2], "prompt_embeds": [encode_span(0, big)] * 2}
    assert client.post("/v1/completions", json=body).status_code == 413  # the body limit
    body = {"history": ["item1"], "truncate_history": True, "prompt_embeds": [span()]}
    answer = client.post("/v1/recommend", json=body)
    assert answer.status_code == 400 and "truncate_history" in answer.json()["error"]


def test_chat_applies_the_folders_template(client, chat_engine, served_model_dir):
    messages = [{"role": "system", "content": "<a_3>"}, {"role": "user", "content": "<b_4> <c_5>"}]
    answer = client.post(
        "/v1/chat/completions", json={"messages": messages, "n": 3, "beam_width": 16}
    )
    assert answer.status_code == 200, answer.text
    data = answer.json()
    text = chat_engine.chat_prompt(messages)
    assert text == "<t1> <a_3> <b_4> <c_5> "
    (want,) = chat_engine.recommend([text], 16, 16, 3)
    assert [c["message"]["content"] for c in data["choices"]] == codes_of(chat_engine, want)
    assert (
        data["object"] == "chat.completion" and data["choices"][0]["message"]["role"] == "assistant"
    )
    first = data["choices"][0]
    codes = want.semantic_ids[0][0]
    sid = chat_engine.catalog.find_semantic_id(codes)
    assert first["item_ids"] == chat_engine.catalog.items_of_semantic_id(sid)
    assert data["usage"]["prompt_tokens"] == 4
    refused = client.post(
        "/v1/chat/completions", json={"messages": messages, "n": 3, "beam_width": 2}
    )
    assert refused.status_code == 400 and "n (3)" in refused.json()["error"]
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 422
    with TestClient(create_app(Engine.from_pretrained(served_model_dir))) as plain:
        answer = plain.post("/v1/chat/completions", json={"messages": messages})
    assert answer.status_code == 400 and "no chat template" in answer.json()["error"]


def test_client_forms_against_a_running_server(chat_engine):
    history = ["item3", "item9"]
    prompt = chat_engine.token_ids(chat_engine.history_prompt(history))
    spans = [(1, rows(2, 7).numpy())]
    with live_server(create_app(chat_engine)) as url, Client(url) as client:
        got = client.recommend(history, beam_width=16, num_results=4, prompt_embeds=spans)
        (want,) = chat_engine.recommend(
            [Prompt(prompt, spans)], 16, 16, 4, exclude_item_ids=[history]
        )
        assert [r.item_id for r in got.items] == [r.item_id for r in want.items]
        ids = [1, 8 + 3, 8 + 16 + 4]
        got = client.complete(ids, n=4, beam_width=16, prompt_embeds=[(1, rows(1, 8))])
        (want,) = chat_engine.recommend([Prompt(ids, [(1, rows(1, 8))])], 16, 16, 4)
        assert [c for c, _ in got.semantic_ids] == [c for c, _ in want.semantic_ids]
        np.testing.assert_allclose(
            [s for _, s in got.semantic_ids], [s for _, s in want.semantic_ids], atol=1e-5
        )
        whole = rows(4, 9, torch.bfloat16)
        got = client.complete(n=2, beam_width=8, prompt_embeds=whole)
        (want,) = chat_engine.recommend([Prompt(embeds=whole)], 8, 8, 2)
        assert [c for c, _ in got.semantic_ids] == [c for c, _ in want.semantic_ids]
        messages = [{"role": "user", "content": "<a_3> <b_4>"}]
        got = client.chat(messages, n=3, beam_width=16)
        (want,) = chat_engine.recommend([chat_engine.chat_prompt(messages)], 16, 16, 3)
        assert [c for c, _ in got.semantic_ids] == [c for c, _ in want.semantic_ids]
        assert got.items and got.items[0].semantic_id == want.semantic_ids[0][0]
        with pytest.raises(ServerError, match="outside the prompt"):
            client.complete([1, 2], prompt_embeds=[(5, rows(1, 1))])
