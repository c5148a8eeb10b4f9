"""Several catalogs behind one server: requests pick one by name, /v1/models lists them, each
has its own versions behind the admin API, and the metrics carry a catalog label."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient

from tests.conftest import live_server
from tests.server.test_app import metric_values
from xgr import Client, Engine, ItemCatalog, XgrError
from xgr.client import ServerError
from xgr.server.app import create_app
from xgr.server.config import ServerConfig

TOKEN = "s3cret-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SEARCH = {"beam_width": 16, "num_results": 5}


def second_market(us: ItemCatalog) -> ItemCatalog:
    """Part of the trained catalog (same codes) and items of its own."""
    rng = np.random.default_rng(5)
    ids = [*us.item_ids[100:], *(f"eu{k}" for k in range(40))]
    codes = np.concatenate([us.codes[100:], rng.integers(0, us.codebook_size, (40, 3))])
    return ItemCatalog.from_codes(ids, codes, us.codebook_size)


@pytest.fixture(scope="module")
def served(served_model_dir):
    us = ItemCatalog.from_index_json(served_model_dir / "catalog.index.json")
    eu = second_market(us)
    engine = Engine.from_pretrained(served_model_dir, catalog={"us": us, "eu": eu})
    alone = Engine.from_pretrained(served_model_dir, catalog=eu)
    config = ServerConfig(admin_token=TOKEN)
    with TestClient(create_app(engine, config)) as client:
        yield engine, alone, client


def test_requests_pick_their_catalog(served):
    engine, alone, client = served
    eu_ids = set(engine.catalogs["eu"].catalog.item_ids)
    body = {"history": ["item150"], **SEARCH}
    eu = client.post("/v1/recommend", json={**body, "catalog": "eu"}).json()
    assert eu["catalog"] == "eu" and eu["catalog_version"] == 1
    assert {i["item_id"] for i in eu["items"]} <= eu_ids
    want = alone.recommend([alone.history_prompt(["item150"])], 16, 16, 5)[0]
    assert [i["item_id"] for i in eu["items"]] == [
        r.item_id for r in want.items if r.item_id != "item150"
    ][: len(eu["items"])]
    us = client.post("/v1/recommend", json=body).json()
    assert us["catalog"] == "us" and us["items"] != eu["items"]
    # An item only one market has is history only there.
    refused = client.post("/v1/recommend", json={"history": ["eu3"], **SEARCH})
    assert refused.status_code == 400 and "eu3" in refused.json()["error"]
    assert client.post(
        "/v1/recommend", json={"history": ["eu3"], **SEARCH, "catalog": "eu"}
    ).status_code == 200  # fmt: skip
    completion = client.post(
        "/v1/completions", json={"prompt": [1, 11, 28], "n": 3, "catalog": "eu"}
    ).json()
    assert completion["catalog"] == "eu"
    assert {i for c in completion["choices"] for i in c["item_ids"]} <= eu_ids
    for path, request in (
        ("/v1/recommend", body),
        ("/v1/completions", {"prompt": [1, 2], "n": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        answer = client.post(path, json={**request, "catalog": "asia"})
        assert answer.status_code == 400, path
        assert "no catalog named 'asia'; this engine serves ['us', 'eu']" in answer.json()["error"]


def test_models_lists_the_catalogs(served):
    engine, _, client = served
    card = client.get("/v1/models").json()["data"][0]
    assert [c["name"] for c in card["catalogs"]] == ["us", "eu"]
    eu = card["catalogs"][1]
    assert eu["num_items"] == len(engine.catalogs["eu"].catalog) == 240
    assert card["num_items"] == card["catalogs"][0]["num_items"] == 300


def test_admin_updates_one_catalog_at_a_time(served):
    engine, _, client = served
    info = client.get("/v1/catalog?catalog=eu", headers=AUTH).json()
    assert info["catalog"] == "eu" and info["num_items"] == 240
    before_us = client.get("/v1/catalog", headers=AUTH).json()
    assert before_us["catalog"] == "us"
    updated = client.post(
        "/v1/catalog?catalog=eu", headers=AUTH, json={"remove": ["eu0", "eu1"]}
    ).json()
    assert updated["catalog"] == "eu" and updated["num_items"] == 238
    version = updated["catalog_version"]
    assert client.get("/v1/catalog", headers=AUTH).json() == before_us  # untouched
    answer = client.post("/v1/recommend", json={"history": ["eu3"], **SEARCH, "catalog": "eu"})
    assert answer.json()["catalog_version"] == version
    assert not {"eu0", "eu1"} & {i["item_id"] for i in answer.json()["items"]}
    values = metric_values(client)
    eu_label = (("catalog", "eu"), ("model_name", engine.name))
    assert values[("xgr:catalog_version", eu_label)] == version
    assert values[("xgr:e2e_request_latency_seconds_count", eu_label)] >= 1
    back = client.post("/v1/catalog/rollback?catalog=eu", headers=AUTH).json()
    assert back["catalog"] == "eu" and back["catalog_version"] == version - 1
    unknown = client.get("/v1/catalog?catalog=asia", headers=AUTH)
    assert unknown.status_code == 400 and "no catalog named 'asia'" in unknown.json()["error"]
    assert client.get("/v1/catalog?catalog=asia").status_code == 401  # auth first


def test_the_client_picks_catalogs_and_reads_their_versions(served):
    engine, _, _ = served
    with live_server(create_app(engine)) as url, Client(url) as client:
        eu = client.recommend(["eu3"], beam_width=16, num_results=5, catalog="eu")
        assert eu.catalog == "eu" and eu.catalog_version == engine.catalogs["eu"].version
        assert {r.item_id for r in eu.items} <= set(engine.catalogs["eu"].catalog.item_ids)
        completed = client.complete([1, 11, 28], n=3, catalog="eu")
        assert completed.catalog == "eu" and completed.semantic_ids
        assert client.recommend(["item3"], beam_width=16).catalog == "us"
        with pytest.raises(ServerError, match="no catalog named 'asia'"):
            client.complete([1, 2], n=2, catalog="asia")


def test_query_parameters_and_repeated_keys_are_refused_not_ignored(served):
    engine, _, client = served
    versions = {name: s.version for name, s in engine.catalogs.items()}
    for method, path, body in (
        ("POST", "/v1/catalog?catlog=eu", {"remove": ["eu30"]}),
        ("POST", "/v1/catalog?catalog=eu&catalog=us", {"remove": ["eu30"]}),
        ("POST", "/v1/catalog/rollback?Catalog=eu", None),
        ("GET", "/v1/catalog?catalog=eu&x=1", None),
    ):
        answer = client.request(method, path, headers=AUTH, json=body)
        assert answer.status_code == 400, (path, answer.text)
    for path, body in (
        ("/v1/recommend?catalog=eu", {"history": ["item150"], **SEARCH}),
        ("/v1/completions?catalog=eu", {"prompt": [1, 2], "n": 2}),
    ):
        answer = client.post(path, json=body)
        assert answer.status_code == 400 and "takes no query parameters" in answer.json()["error"]
    twice = b'{"remove": ["eu30"], "remove": ["eu31"]}'
    answer = client.post("/v1/catalog?catalog=eu", headers={**AUTH, "content-type":
                         "application/json"}, content=twice)  # fmt: skip
    assert answer.status_code == 400 and "'remove' twice" in answer.json()["error"]
    assert {name: s.version for name, s in engine.catalogs.items()} == versions


def test_a_completion_names_each_choices_version(served):
    _, _, client = served
    answer = client.post("/v1/completions", json={"prompt": [[1, 11], [1, 12]], "n": 2}).json()
    assert {c["catalog_version"] for c in answer["choices"]} == {answer["catalog_version"]}


def test_admin_tokens_are_printable_ascii():
    with pytest.raises(XgrError, match="printable ASCII"):
        ServerConfig(admin_token="é" * 16)
