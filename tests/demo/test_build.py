"""A demo folder whose files or data changed since its build is refused, not served."""

from __future__ import annotations

import json

import pytest

from xgr.core import XgrError
from xgr.demo.build import DEMO_METADATA_FILE, REQUIRED_FILES, check_demo_files


@pytest.fixture
def cache(tmp_path):
    model = tmp_path / "model-x"
    model.mkdir()
    for name in REQUIRED_FILES:
        (model / name).write_text(f"contents of {name}")
    (model / DEMO_METADATA_FILE).write_text(json.dumps({"config": {}}))
    data = tmp_path / "ml-100k"
    data.mkdir()
    for name in ("ml-100k.inter", "ml-100k.item"):
        (data / name).write_text(f"rows of {name}")
    return tmp_path


def test_digests_are_recorded_on_first_use_then_checked(cache):
    model = cache / "model-x"
    check_demo_files(model, cache)
    digests = json.loads((model / DEMO_METADATA_FILE).read_text())["digests"]
    assert set(digests) == {*REQUIRED_FILES, "ml-100k/ml-100k.inter", "ml-100k/ml-100k.item"}
    check_demo_files(model, cache)  # unchanged: accepted
    (model / "model.safetensors").write_text("damaged")
    with pytest.raises(XgrError, match="model.safetensors changed since the demo model"):
        check_demo_files(model, cache)


def test_changed_data_and_missing_files_are_named(cache):
    model = cache / "model-x"
    check_demo_files(model, cache)
    (cache / "ml-100k" / "ml-100k.inter").write_text("rows of ml-100k")  # truncated
    with pytest.raises(XgrError, match="ml-100k/ml-100k.inter changed"):
        check_demo_files(model, cache)
    (model / "xgr_prompt.json").unlink()
    with pytest.raises(XgrError, match="lacks xgr_prompt.json: delete"):
        check_demo_files(model, cache)


def test_a_catalog_record_without_items_gets_them_once_its_files_check(cache):
    from tests.conftest import random_catalog
    from xgr.demo.build import CATALOG_INDEX_FILE

    model = cache / "model-x"
    catalog = random_catalog(30, 3, 8, seed=1)
    catalog.to_index_json(model / CATALOG_INDEX_FILE)
    old = {"fingerprint": catalog.fingerprint, "num_items": 30}  # a record of earlier builds
    (model / "xgr_catalog.json").write_text(json.dumps(old))
    check_demo_files(model, cache)  # digests recorded, then the record completed
    record = json.loads((model / "xgr_catalog.json").read_text())
    assert record["items"] == {i: catalog.codes[r].tolist() for r, i in enumerate(catalog.item_ids)}
    check_demo_files(model, cache)  # its digest follows: still accepted
    other = random_catalog(30, 3, 8, seed=2)  # a record of another catalog is left alone
    (model / "xgr_catalog.json").write_text(json.dumps({"fingerprint": other.fingerprint}))
    meta = json.loads((model / DEMO_METADATA_FILE).read_text())
    del meta["digests"]
    (model / DEMO_METADATA_FILE).write_text(json.dumps(meta))
    check_demo_files(model, cache)
    assert "items" not in json.loads((model / "xgr_catalog.json").read_text())
