"""History -> prompt token ids."""

from __future__ import annotations

import json

import pytest

from tests.conftest import sequential_sid_map
from xgr import ItemCatalog, XgrError
from xgr.engine.prompt import PROMPT_FORMAT_FILE, PromptFormat

CATALOG = ItemCatalog.from_codes(["x", "y", "z"], [[0, 1], [2, 3], [0, 1]], 4)
SID_MAP = sequential_sid_map(2, 4, 10)  # level 0 -> 10..13, level 1 -> 14..17


def test_build_prefix_items_suffix():
    fmt = PromptFormat(prefix=(1,), suffix=(2, 3))
    assert fmt.build(["x", "y"], CATALOG, SID_MAP) == [1, 10, 15, 12, 17, 2, 3]
    assert fmt.num_tokens(2, 2) == 7


def test_history_cap_and_truncation_keep_the_newest_items():
    assert PromptFormat(max_history_items=1).build(["x", "y"], CATALOG, SID_MAP) == [12, 17]
    fmt = PromptFormat(prefix=(1,))
    assert fmt.build(["x", "y", "z"], CATALOG, SID_MAP, max_tokens=6) == [1, 12, 17, 10, 15]
    with pytest.raises(XgrError, match="needs 3 tokens"):
        fmt.build(["x"], CATALOG, SID_MAP, max_tokens=2)


def test_bad_histories():
    with pytest.raises(XgrError, match="empty history"):
        PromptFormat().build([], CATALOG, SID_MAP)
    with pytest.raises(XgrError, match=r"\['q', 'r'\]"):
        PromptFormat().build(["x", "q", "r"], CATALOG, SID_MAP)
    # A bare string is not read character by character.
    with pytest.raises(XgrError, match="got the string 'xy'"):
        PromptFormat().build("xy", CATALOG, SID_MAP)
    with pytest.raises(XgrError, match="got dict"):
        PromptFormat().build({"x": 1}, CATALOG, SID_MAP)


def test_from_model_dir(tmp_path):
    assert PromptFormat.from_model_dir(tmp_path, {}) == PromptFormat()
    (tmp_path / PROMPT_FORMAT_FILE).write_text(
        json.dumps({"prefix_tokens": ["<bos>"], "max_history_items": 5})
    )
    fmt = PromptFormat.from_model_dir(tmp_path, {"<bos>": 7})
    assert fmt == PromptFormat(prefix=(7,), max_history_items=5)
    with pytest.raises(XgrError, match="<bos>"):
        PromptFormat.from_model_dir(tmp_path, {})
    (tmp_path / PROMPT_FORMAT_FILE).write_text(json.dumps({"max_history_items": 0}))
    with pytest.raises(XgrError, match="max_history_items"):
        PromptFormat.from_model_dir(tmp_path, {})
