"""The server tests' engine over the served model folder, and a live server of it."""

from __future__ import annotations

import pytest

from tests.conftest import live_server
from xgr import Engine
from xgr.server.app import create_app


@pytest.fixture(scope="module")
def engine(served_model_dir):
    return Engine.from_pretrained(served_model_dir)


@pytest.fixture(scope="module")
def base_url(engine):
    with live_server(create_app(engine)) as url:
        yield url
