"""schemathesis against the served OpenAPI document: no 5xx, every answer as declared.

Cases per operation: ``XGR_FUZZ_EXAMPLES`` (default 25, small for CI; raise it for a long
run, and add ``--hypothesis-show-statistics`` to see how many ran). The app runs under a
real uvicorn server on 127.0.0.1.
"""

from __future__ import annotations

import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from tests.conftest import live_server
from xgr import Engine
from xgr.server.app import create_app
from xgr.server.config import ServerConfig

EXAMPLES = int(os.environ.get("XGR_FUZZ_EXAMPLES", "25"))


@pytest.fixture(scope="module")
def base_url(served_model_dir):
    engine = Engine.from_pretrained(served_model_dir)
    config = ServerConfig(max_beam_width=32, default_beam_width=16, max_body_bytes=64 * 1024)
    with live_server(create_app(engine, config=config)) as url:
        yield url


@pytest.fixture(scope="module")
def api_schema(base_url):
    return schemathesis.openapi.from_url(f"{base_url}/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_conforms_to_its_schema(case):
    response = case.call(timeout=60)
    assert response.status_code < 500, response.text
    # Every default check but "schema-valid data must be accepted": a schema-valid body can
    # still name items the catalog lacks or exceed this server's configured limits (400).
    case.validate_response(response, excluded_checks=[positive_data_acceptance])
