"""Every endpoint and every error of the HTTP API, through FastAPI's TestClient."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from xgr import Engine
from xgr.core import XgrError
from xgr.server.app import create_app
from xgr.server.config import ServerConfig


@pytest.fixture(scope="module")
def client(engine):
    config = ServerConfig(max_beam_width=128, max_body_bytes=64 * 1024)
    with TestClient(create_app(engine, config)) as client:
        yield client


def metric_values(client) -> dict[tuple[str, tuple], float]:
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_health_ready_models(client, engine):
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").json() == {"status": "ready"}
    (card,) = client.get("/v1/models").json()["data"]
    assert card["id"] == engine.name
    assert (card["num_items"], card["num_semantic_ids"], card["num_levels"]) == (
        300,
        engine.catalog.num_semantic_ids,
        3,
    )
    assert card["max_prompt_tokens"] == 254


def test_not_ready_before_warm_up(engine):
    client = TestClient(create_app(engine))  # no lifespan: no warm-up has run
    assert client.get("/ready").status_code == 503
    assert client.get("/health").status_code == 200


def test_recommend_matches_engine(client, engine):
    history = ["item3", "item17", "item250"]
    body = {"history": history, "beam_width": 16, "num_results": 5, "request_id": "r1"}
    response = client.post("/v1/recommend", json=body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["request_id"] == "r1" and data["model"] == engine.name
    prompt = engine.history_prompt(["item3", "item17", "item250"])
    assert prompt[0] == 1 and len(prompt) == 1 + 3 * 3
    (expected,) = engine.recommend(
        [prompt],
        beam_width=16,
        top_k=16,
        num_results=5,
        exclude_item_ids=[{"item3", "item17", "item250"}],
    )
    assert [i["item_id"] for i in data["items"]] == [r.item_id for r in expected.items]
    assert [i["score"] for i in data["items"]] == pytest.approx([r.score for r in expected.items])
    first = data["items"][0]
    assert first["title"] == f"Title of {first['item_id']}"
    assert first["semantic_id"] == engine.catalog.format_semantic_id(expected.items[0].semantic_id)
    timings = data["timings"]
    assert timings["total_ms"] >= timings["prefill_ms"] > 0 and timings["queue_ms"] >= 0


def test_semantic_id_history_equals_item_history(client, engine):
    sid = engine.catalog.format_semantic_id(engine.catalog.codes_of("item5"))
    by_sid = client.post("/v1/recommend", json={"history": [sid], "beam_width": 16}).json()
    by_id = client.post("/v1/recommend", json={"history": ["item5"], "beam_width": 16}).json()
    assert [i["item_id"] for i in by_sid["items"]] == [i["item_id"] for i in by_id["items"]]


def test_exclude_history(client):
    top = client.post("/v1/recommend", json={"history": ["item1"], "beam_width": 16}).json()
    best = top["items"][0]["item_id"]
    kept = client.post(
        "/v1/recommend", json={"history": [best], "beam_width": 16, "exclude_history": False}
    ).json()
    excluded = client.post("/v1/recommend", json={"history": [best], "beam_width": 16}).json()
    assert best not in {i["item_id"] for i in excluded["items"]}
    assert len({i["item_id"] for i in kept["items"]}) == len(kept["items"])
    assert kept["complete"] and excluded["complete"]


def test_exclusions_of_the_best_beams_are_refilled_inside_the_search(client):
    # The prompt holds the 20 most recent items; older ones are still excluded. Prepending
    # the items of both final beams (beam 2) to the history leaves the prompt unchanged and
    # excludes every item they hold: the search finds two other semantic IDs instead.
    recent = [f"item{i}" for i in range(20)]
    body = {"history": recent, "beam_width": 2, "num_results": 2, "exclude_history": False}
    top = client.post("/v1/recommend", json=body).json()
    assert top["complete"] and len({i["semantic_id"] for i in top["items"]}) == 2
    beams_items = [i["item_id"] for i in top["items"]]
    body = {"history": beams_items + recent, "beam_width": 2, "num_results": 2}
    answer = client.post("/v1/recommend", json=body)
    assert answer.status_code == 200
    excluded = set(beams_items + recent)
    got = answer.json()
    assert not excluded & {i["item_id"] for i in got["items"]}
    assert got["complete"] is True and len({i["semantic_id"] for i in got["items"]}) == 2
    assert not {i["semantic_id"] for i in got["items"]} & {i["semantic_id"] for i in top["items"]}


def test_long_history_is_capped_by_the_prompt_format(client):
    history = [f"item{i}" for i in range(100)]
    ok = client.post("/v1/recommend", json={"history": history, "beam_width": 8, "num_results": 2})
    assert ok.status_code == 200  # 20 most recent items: 61 tokens


def test_prompt_too_long_is_413_or_truncated(served_model_dir):
    engine = Engine.from_pretrained(served_model_dir)
    engine.prompt_format = type(engine.prompt_format)(prefix=(1,))  # no history cap
    history = [f"item{i % 300}" for i in range(120)]  # 361 tokens > 254
    with TestClient(create_app(engine)) as client:
        body = {"history": history, "beam_width": 8, "num_results": 2, "exclude_history": False}
        too_long = client.post("/v1/recommend", json=body)
        assert too_long.status_code == 413
        assert "exceeds the model's limit of 254" in too_long.json()["error"]
        cut = client.post("/v1/recommend", json={**body, "truncate_history": True})
        assert cut.status_code == 200
        newest = history[-84:]  # (254 - 1) // 3 items fit
        alone = client.post("/v1/recommend", json={**body, "history": newest})
        assert [i["item_id"] for i in cut.json()["items"]] == [
            i["item_id"] for i in alone.json()["items"]
        ]


def test_deadline_passed_in_queue_is_504(client):
    body = {"history": ["item1"], "beam_width": 8, "num_results": 2, "deadline_ms": 0.001}
    response = client.post("/v1/recommend", json=body)
    assert response.status_code == 504
    assert "deadline" in response.json()["error"]


def test_completions_with_text_and_token_ids(client, engine):
    text = "<t1> <a_3> <b_4> <c_5>"
    ids = [1, 8 + 3, 8 + 16 + 4, 8 + 32 + 5]
    by_text = client.post("/v1/completions", json={"prompt": text, "n": 4, "beam_width": 16})
    assert by_text.status_code == 200, by_text.text
    data = by_text.json()
    (expected,) = engine.recommend([ids], beam_width=16, top_k=16, num_results=4)
    assert [c["text"] for c in data["choices"]] == [
        engine.catalog.format_semantic_id(codes) for codes, _ in expected.semantic_ids
    ]
    assert [c["index"] for c in data["choices"]] == [0, 1, 2, 3]
    first = data["choices"][0]
    assert first["finish_reason"] == "length"
    codes = expected.semantic_ids[0][0]
    assert first["item_ids"] == engine.catalog.items_of_semantic_id(
        engine.catalog.find_semantic_id(codes)
    )
    assert data["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    by_ids = client.post(
        "/v1/completions", json={"prompt": ids, "n": 4, "beam_width": 16, "max_tokens": 3}
    ).json()
    assert [c["text"] for c in by_ids["choices"]] == [c["text"] for c in data["choices"]]


def test_level_scores_over_http(client, engine):
    body = {"history": ["item2", "item9"], "beam_width": 16, "num_results": 4}
    plain = client.post("/v1/recommend", json=body).json()["items"]
    assert all(item["level_scores"] is None for item in plain)
    scored = client.post("/v1/recommend", json={**body, "return_level_scores": True}).json()
    prompt = engine.history_prompt(["item2", "item9"])
    (want,) = engine.recommend([prompt], 16, 16, 4, exclude_item_ids=[{"item2", "item9"}])
    assert [i["item_id"] for i in scored["items"]] == [r.item_id for r in want.items]
    for item, expected in zip(scored["items"], want.items, strict=True):
        assert item["level_scores"] == pytest.approx(list(expected.level_scores), abs=1e-6)
        assert sum(item["level_scores"]) == pytest.approx(item["score"], abs=1e-5)


def test_completions_logprobs(client, engine):
    ids = [1, 8 + 3, 8 + 16 + 4, 8 + 32 + 5]
    body = {"prompt": ids, "n": 3, "beam_width": 16}
    assert all(
        c["logprobs"] is None for c in client.post("/v1/completions", json=body).json()["choices"]
    )
    data = client.post("/v1/completions", json={**body, "logprobs": 0}).json()
    (want,) = engine.recommend([ids], beam_width=16, top_k=16, num_results=3)
    for choice, levels in zip(data["choices"], want.level_scores, strict=True):
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"]
        assert logprobs["text_offset"] == [choice["text"].index(t) for t in logprobs["tokens"]]
        assert logprobs["token_logprobs"] == pytest.approx(list(levels), abs=1e-6)
        assert sum(logprobs["token_logprobs"]) == pytest.approx(choice["score"], abs=1e-5)
        assert logprobs["top_logprobs"] is None
    refused = client.post("/v1/completions", json={**body, "logprobs": 2})
    assert refused.status_code == 400 and "logprobs must be 0" in refused.json()["error"]


def test_completions_with_several_prompts(client):
    prompts = [[1, 11, 28], [1, 12]]
    data = client.post("/v1/completions", json={"prompt": prompts, "n": 2}).json()
    assert len(data["choices"]) == 4
    alone = client.post("/v1/completions", json={"prompt": prompts[1], "n": 2}).json()
    assert [c["text"] for c in data["choices"][2:]] == [c["text"] for c in alone["choices"]]
    assert data["usage"]["prompt_tokens"] == 5


def test_metrics_move_with_traffic(client, engine):
    before = metric_values(client)
    for _ in range(3):
        assert (
            client.post("/v1/recommend", json={"history": ["item2"], "beam_width": 16}).status_code
            == 200
        )
    after = metric_values(client)
    model = (("model_name", engine.name),)
    label = (("catalog", "default"), *model)  # request metrics name the catalog searched
    success = ("xgr:request_success_total", (label[0], ("finished_reason", "length"), *model))
    assert after[success] - before.get(success, 0) == 3
    count = ("xgr:e2e_request_latency_seconds_count", label)
    assert after[count] - before.get(count, 0) == 3
    for name in (
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_prompt_tokens",
        "batch_size",
    ):
        assert after[(f"xgr:{name}_count", label)] >= 3
    assert ("xgr:num_requests_running", model) in after
    assert ("xgr:num_requests_waiting", model) in after
    assert after[("xgr:catalog_version", label)] == 1
    tokens = ("xgr:request_prompt_tokens_sum", label)
    assert after[tokens] - before.get(tokens, 0) == 3 * 4


@pytest.mark.parametrize(
    ("path", "body", "status", "fragment"),
    [
        ("/v1/recommend", {"history": ["nope", "item1", 12345]}, 400, "'nope', '12345'"),
        ("/v1/recommend", {"history": ["<a_99><b_1><c_1>"]}, 400, "<a_99><b_1><c_1>"),
        ("/v1/recommend", {"history": ["<a_1>"]}, 400, "<a_1>"),
        ("/v1/recommend", {"history": []}, 422, "history"),
        ("/v1/recommend", {"history": ["item1"], "beam_width": 0}, 422, "beam_width"),
        ("/v1/recommend", {"history": ["item1"], "beam_width": 129}, 400, "limit 128"),
        (
            "/v1/recommend",
            {"history": ["item1"], "beam_width": 4, "num_results": 5},
            400,
            "num_results",
        ),
        ("/v1/recommend", {"history": ["item1"], "colour": "red"}, 422, "colour"),
        ("/v1/recommend", {"history": "item1"}, 422, "history"),
        ("/v1/recommend", {"history": [1.5]}, 422, "history"),
        ("/v1/recommend", {"history": ["item1"], "beam_width": "wide"}, 422, "beam_width"),
        ("/v1/completions", {"prompt": [1, 2], "max_tokens": 4}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": [1, 2], "model": "other"}, 404, "other"),
        ("/v1/completions", {"prompt": [1, 2], "use_beam_search": False}, 400, "beam search"),
        ("/v1/completions", {"prompt": []}, 400, "empty"),
        ("/v1/completions", {"prompt": [[1], []]}, 400, "prompt 1 is empty"),
        ("/v1/completions", {"prompt": [1, 96]}, 400, "token ids"),
        ("/v1/completions", {"prompt": [1], "n": 3, "beam_width": 2}, 400, "n (3) must not"),
        ("/v1/completions", {"prompt": [1], "n": 8, "best_of": 4}, 400, "(4, from beam_width"),
        ("/v1/completions", {"prompt": "<a_99>"}, 400, "unknown token '<a_99>' at character 0"),
        ("/v1/completions", {"prompt": "<t1> hello <a_3>"}, 400, "unknown token 'hello'"),
        ("/v1/completions", {"prompt": ["<t1>", "<a_3 >"]}, 400, "prompt 1: unknown token '<a_3'"),
        ("/v1/completions", {"prompt": [1] * 300}, 413, "exceeds"),
        ("/v1/completions", {"prompt": [1], "n": 200}, 400, "n (200) exceeds this server's"),
        ("/v1/completions", {"prompt": [[1], [1] * 300]}, 413, "prompt 1: prompt of 300"),
        ("/v1/completions", {"prompt": {"a": 1}}, 422, "prompt"),
        ("/v1/completions", {"prompt": [[1]] * 257}, 400, "at most 256"),
        ("/v1/recommend", {"history": [True]}, 422, "history"),
        ("/v1/recommend", {"history": ["item1"], "beam_width": True}, 422, "beam_width"),
        ("/v1/recommend", {"history": ["<a_" + "9" * 5000 + "><b_1><c_1>"]}, 400, "unknown"),
    ],
)
def test_bad_requests_get_4xx_with_a_reason(client, path, body, status, fragment):
    response = client.post(path, json=body)
    assert response.status_code == status, response.text
    assert fragment in response.text


def test_malformed_json_and_huge_body(client):
    response = client.post(
        "/v1/recommend", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["error"] == "invalid request body"
    huge = {"history": ["item1"] * 20_000}
    response = client.post("/v1/recommend", json=huge)
    assert response.status_code == 413
    assert "exceeds 65536 bytes" in response.json()["error"]

    def chunks():
        for _ in range(100):
            yield b" " * 1024

    response = client.post(
        "/v1/recommend", content=chunks(), headers={"content-type": "application/json"}
    )
    assert response.status_code == 413


def test_completion_indexes_follow_openai_numbering_with_a_small_catalog(tmp_path):
    from tests.conftest import random_catalog, sequential_sid_map, write_random_model

    write_random_model(tmp_path, "qwen2")
    catalog = random_catalog(4, 3, 16, seed=3)  # at most 4 semantic IDs per prompt
    engine = Engine.from_pretrained(tmp_path, catalog, sid_token_ids=sequential_sid_map(3, 16, 8))
    with TestClient(create_app(engine)) as client:
        body = {"prompt": [[1, 2], [3, 4]], "n": 6, "beam_width": 8}
        choices = client.post("/v1/completions", json=body).json()["choices"]
    count = catalog.num_semantic_ids
    assert [c["index"] for c in choices] == [*range(count), *range(6, 6 + count)]


def test_server_config_refuses_a_beam_limit_past_the_api_limit():
    from xgr.server.schemas import MAX_BEAM_WIDTH

    with pytest.raises(XgrError, match=f"limit of {MAX_BEAM_WIDTH}"):
        ServerConfig(max_beam_width=MAX_BEAM_WIDTH + 1)
    assert ServerConfig(max_beam_width=MAX_BEAM_WIDTH).max_beam_width == MAX_BEAM_WIDTH


def test_empty_request_id_is_echoed(client):
    body = {"history": ["item3"], "beam_width": 8, "num_results": 2, "request_id": ""}
    assert client.post("/v1/recommend", json=body).json()["request_id"] == ""
    del body["request_id"]
    assert len(client.post("/v1/recommend", json=body).json()["request_id"]) == 32


def test_the_warm_up_batch_is_not_in_the_metrics(engine):
    with TestClient(create_app(engine, ServerConfig(max_beam_width=128))) as fresh:
        label = (("catalog", "default"), ("model_name", engine.name))
        assert metric_values(fresh).get(("xgr:batch_size_count", label), 0) == 0
        body = {"history": ["item3"], "beam_width": 8, "num_results": 2}
        assert fresh.post("/v1/recommend", json=body).status_code == 200
        after = metric_values(fresh)
        assert after[("xgr:batch_size_count", label)] == 1
        assert after[("xgr:batch_size_sum", label)] == 1


def test_completions_refuse_beam_width_and_best_of_that_differ(client):
    body = {"prompt": [1, 2], "beam_width": 8, "best_of": 16, "max_tokens": 3}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 400
    assert "beam_width (8) and its alias best_of (16) differ" in answer.json()["error"]


def post_body(client, content: bytes, content_type: str = "application/json"):
    """POST raw bytes to /v1/recommend (bodies a JSON encoder would not produce)."""
    return client.post("/v1/recommend", content=content, headers={"content-type": content_type})


def test_body_that_is_not_utf8_is_a_clear_422(client):
    answer = post_body(client, b'{"history": ["\xff\xfe"]}')
    assert answer.status_code == 422
    assert answer.json()["error"].startswith("invalid request body: not parsable JSON text")


def test_body_sent_as_text_says_json_is_expected(client):
    answer = post_body(client, b'{"history": ["item1"]}', "text/plain")
    assert answer.status_code == 422
    assert answer.json()["error"] == (
        "invalid request body: send JSON with content-type application/json"
    )


def test_nan_deadline_is_named_as_not_finite(client):
    answer = post_body(client, b'{"history": ["item1"], "deadline_ms": NaN}')
    assert answer.status_code == 422
    (detail,) = answer.json()["detail"]
    assert detail["loc"][-1] == "deadline_ms" and detail["msg"] == "Input should be a finite number"
