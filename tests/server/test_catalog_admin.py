"""The catalog admin API: off without a token, bearer-token auth, updates and rollbacks that
the next requests see (each answer naming its catalog_version), refusals that change nothing,
and its own body limit."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from xgr import Engine, XgrError
from xgr.server.app import create_app
from xgr.server.config import ServerConfig

TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture()
def admin(served_model_dir):
    engine = Engine.from_pretrained(served_model_dir)
    config = ServerConfig(admin_token=TOKEN, max_body_bytes=4096, max_catalog_body_bytes=1 << 20)
    with TestClient(create_app(engine, config)) as client:
        yield engine, client


def test_the_api_is_off_without_a_token(served_model_dir):
    with TestClient(create_app(Engine.from_pretrained(served_model_dir))) as client:
        assert client.get("/v1/catalog").status_code == 404
        assert client.post("/v1/catalog", json={"remove": ["item1"]}).status_code == 404
    for token in ("short", "with a space 0123456789", 12345678901234567):
        with pytest.raises(XgrError, match="at least 16 printable"):
            ServerConfig(admin_token=token)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-token-0123456789"},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
    ],  # fmt: skip
)
def test_requests_without_the_token_are_refused(admin, headers):
    engine, client = admin
    for method, path, body in (
        ("get", "/v1/catalog", None),
        ("post", "/v1/catalog", {"remove": ["item1"]}),
        ("post", "/v1/catalog/rollback", None),
    ):
        answer = client.request(method.upper(), path, headers=headers, json=body)
        assert answer.status_code == 401, (path, answer.text)
        assert answer.headers["www-authenticate"] == "Bearer"
        assert TOKEN not in answer.text and "Authorization: Bearer" in answer.json()["error"]
    assert engine.catalog_version == 1


def test_updates_and_rollbacks_reach_the_next_requests(admin):
    engine, client = admin
    info = client.get("/v1/catalog", headers=AUTH).json()
    assert info["catalog_version"] == 1 and info["num_items"] == 300
    assert info["fingerprint"] == engine.catalog.fingerprint
    body = {"history": ["item2"], "beam_width": 16, "num_results": 4}
    first = client.post("/v1/recommend", json=body).json()
    assert first["catalog_version"] == 1
    top = first["items"][0]["item_id"]
    # Over the requests' body limit (4 KiB), within the catalog API's.
    added = {f"new{i}": ["<a_1>", "<b_2>", f"<c_{i % 16}>"] for i in range(200)}
    update = client.post("/v1/catalog", headers=AUTH, json={"add": added, "remove": [top]})
    assert update.status_code == 200, update.text
    assert update.json()["catalog_version"] == 2 and update.json()["num_items"] == 499
    assert update.json()["fingerprint"] is None  # GET's: the answer does not wait for it
    assert (
        client.get("/v1/catalog", headers=AUTH).json()["fingerprint"]
        == (engine.catalog.fingerprint)
        != info["fingerprint"]
    )
    second = client.post("/v1/recommend", json=body).json()
    assert second["catalog_version"] == 2
    assert top not in {i["item_id"] for i in second["items"]}
    completion = client.post("/v1/completions", json={"prompt": [1, 11, 28], "n": 2}).json()
    assert completion["catalog_version"] == 2
    refused = client.post("/v1/catalog", headers=AUTH, json={"remove": ["absent"]})
    assert refused.status_code == 400 and "'absent'" in refused.json()["error"]
    assert client.post("/v1/catalog", headers=AUTH, json={"rename": {}}).status_code == 422
    back = client.post("/v1/catalog/rollback", headers=AUTH)
    assert back.status_code == 200 and back.json()["catalog_version"] == 1
    assert client.post("/v1/recommend", json=body).json()["items"] == first["items"]
    again = client.post("/v1/catalog/rollback", headers=AUTH)
    assert again.status_code == 400 and "no earlier catalog version" in again.json()["error"]
    catalog = engine.catalog
    index = {
        item: [f"<{n}_{c}>" for n, c in zip("abc", codes, strict=True)]
        for item, codes in zip(catalog.item_ids[:50], catalog.codes.tolist(), strict=False)
    }
    replaced = client.post("/v1/catalog", headers=AUTH, json={"replace": index})
    assert replaced.json()["catalog_version"] == 3 and replaced.json()["num_items"] == 50
    first_codes = ["<a_0>", "<b_0>", "<c_0>"]
    other = first_codes if index["item0"] != first_codes else ["<a_1>", "<b_1>", "<c_1>"]
    moved = dict(index, item0=other)
    answer = client.post("/v1/catalog", headers=AUTH, json={"replace": moved})
    assert answer.status_code == 400 and "'item0'" in answer.json()["error"]
    huge = {"add": {f"x{i}": ["<a_1>", "<b_1>", "<c_1>"] for i in range(40_000)}}
    assert client.post("/v1/catalog", headers=AUTH, json=huge).status_code == 413
    assert engine.catalog_version == 3
