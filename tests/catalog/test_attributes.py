"""Item attribute tables (CSV, JSON lines) and the filters over them."""

from __future__ import annotations

import numpy as np
import pytest

from xgr import ItemCatalog, XgrError
from xgr.catalog.attributes import compile_filter


def catalog(n=4) -> ItemCatalog:
    return ItemCatalog.from_codes([f"i{k}" for k in range(n)], [[k % 2, k] for k in range(n)], 8)


def passing(cat, spec) -> list[str]:
    rows = np.arange(len(cat))
    keep = compile_filter(spec, cat.attributes).passes(cat.attributes, rows)
    return [cat.item_ids[r] for r in rows[keep]]


def test_csv_columns_are_typed_and_quoted_cells_keep_their_line_breaks(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text(
        'item_id,name,n,price,new,empty\ni0,"x\ny",1,0.5,true,\ni1,z\u2028w,2,1.5,false,\n'
        "i2,z,3,2,true,\nnot-in-catalog,q,9,9,true,\n",
        newline="",
    )
    cat = catalog()
    cat.load_attributes(path)
    assert cat.attributes.kinds == {
        "name": "string", "n": "int", "price": "float", "new": "bool", "empty": "string"
    }  # fmt: skip
    assert passing(cat, {"name": "x\ny"}) == ["i0"]
    assert passing(cat, {"name": "z\u2028w"}) == ["i1"]
    assert passing(cat, {"new": True, "price": {"ge": 0.5, "lt": 2}}) == ["i0"]
    # i3 has no row: it passes no condition but not_in; so does every item on "empty".
    assert passing(cat, {"name": {"not_in": ["z"]}}) == ["i0", "i1", "i3"]
    assert passing(cat, {"empty": {"not_in": ["a"]}}) == ["i0", "i1", "i2", "i3"]
    assert passing(cat, {"n": {"in": (np.int64(1), 3)}}) == ["i0", "i2"]


def test_integer_columns_compare_exactly_with_float_bounds(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"item_id": "i0", "n": 9007199254740993}\n{"item_id": "i1", "n": 2}\n')
    cat = catalog(2)
    cat.load_attributes(path)
    assert passing(cat, {"n": {"le": 9007199254740992.0}}) == ["i1"]
    assert passing(cat, {"n": {"lt": 2.5}}) == ["i1"] and passing(cat, {"n": {"gt": 1.5}}) == [
        "i0", "i1"
    ]  # fmt: skip
    assert passing(cat, {"n": {"ge": 2.5}}) == ["i0"]


def test_json_lines_keep_other_line_separators_inside_strings(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('\ufeff{"item_id": "i0", "s": "x\u2028y"}\n{"item_id": "i1", "s": "z\x85"}\n')
    cat = catalog(2)
    cat.load_attributes(path)
    assert passing(cat, {"s": "x\u2028y"}) == ["i0"]


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.jsonl", '{"item_id": "i0", "a": 1.5}\n{"item_id": "i1", "a": ' + "9" * 400 + "}\n",
         "too large"),
        ("a.csv", "item_id,a\ni0," + "x" * 200_000 + "\n", "field larger"),
        ("a.csv", "item_id,a\ni0,1\ni0,2\n", "appears twice"),
        ("a.csv", "item_id,a\ni0,1,2\n", "cells"),
        ("a.jsonl", '{"item_id": "i0", "a": 1}\n{"item_id": "i1", "a": "x"}\n', "mixes"),
        ("a.txt", "", "expected a .csv or .jsonl"),
    ],
)  # fmt: skip
def test_malformed_tables_are_refused_with_the_reason(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(XgrError, match=message):
        catalog().load_attributes(path)
