"""ItemCatalog: construction, collisions, semantic-ID text, index files, fingerprint, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xgr import ItemCatalog, XgrError
from xgr.catalog import CATALOG_METADATA_FILE
from xgr.catalog.catalog import unique_rows

REAL_INDEX = (
    Path(__file__).resolve().parents[2].parent
    / "shared/data/amazon-industrial/Industrial_and_Scientific.index.json"
)

# Five items, three levels, codebook 8; "b" and "d" collide, so do "c" and "e".
ITEM_IDS = ["a", "b", "c", "d", "e"]
CODES = [[3, 1, 7], [0, 5, 2], [3, 1, 0], [0, 5, 2], [3, 1, 0]]


def write_json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


def small_catalog() -> ItemCatalog:
    return ItemCatalog.from_codes(ITEM_IDS, CODES, 8)


# --- construction ---------------------------------------------------------------------------


def test_from_codes_sizes():
    catalog = small_catalog()
    assert len(catalog) == 5
    assert catalog.num_levels == 3
    assert catalog.num_semantic_ids == 3
    assert catalog.codebook_size == 8
    assert catalog.level_names == ("a", "b", "c")
    assert catalog.item_ids == ITEM_IDS
    assert catalog.codes.dtype == np.int64
    np.testing.assert_array_equal(catalog.codes, np.array(CODES))
    # Distinct semantic IDs, sorted lexicographically; sid_of_item points into them.
    assert catalog.semantic_ids.tolist() == [[0, 5, 2], [3, 1, 0], [3, 1, 7]]
    assert catalog.sid_of_item.tolist() == [2, 0, 1, 0, 1]


def test_from_codes_accepts_numpy_and_torch_and_names_levels():
    np_cat = ItemCatalog.from_codes([10, 11], np.array([[1, 2], [3, 0]]), 4, level_names="xy")
    assert np_cat.item_ids == ["10", "11"]  # ids become strings
    assert np_cat.level_names == ("x", "y")
    assert np_cat.format_semantic_id((1, 2)) == "<x_1><y_2>"
    torch_cat = ItemCatalog.from_codes(["p", "q"], torch.tensor([[1, 2], [3, 0]]), 4)
    np.testing.assert_array_equal(torch_cat.codes, [[1, 2], [3, 0]])
    assert torch_cat.codebook_size == 4


def test_from_codes_codebook_size_is_kept_even_if_unused():
    catalog = ItemCatalog.from_codes(["p"], [[0, 1]], 300)
    assert catalog.codebook_size == 300


def test_from_index_json_sizes(tmp_path):
    path = write_json(
        tmp_path / "index.json",
        {
            "10": ["<a_3>", "<b_1>", "<c_7>"],
            "11": ["<a_0>", "<b_5>", "<c_2>"],
            "12": ["<a_0>", "<b_5>", "<c_2>"],
        },
    )
    catalog = ItemCatalog.from_index_json(path)
    assert len(catalog) == 3
    assert catalog.item_ids == ["10", "11", "12"]
    assert catalog.num_levels == 3
    assert catalog.num_semantic_ids == 2
    assert catalog.codebook_size == 8  # default: largest code + 1
    assert catalog.level_names == ("a", "b", "c")
    assert catalog.codes_of("10") == (3, 1, 7)
    assert ItemCatalog.from_index_json(str(path), codebook_size=256).codebook_size == 256


def test_from_index_json_keeps_level_letters_and_accepts_joined_strings(tmp_path):
    path = write_json(tmp_path / "index.json", {"x": "<p_4><q_0>", "y": ["<p_1>", "<q_9>"]})
    catalog = ItemCatalog.from_index_json(path)
    assert catalog.level_names == ("p", "q")
    assert catalog.codes.tolist() == [[4, 0], [1, 9]]
    assert catalog.codebook_size == 10
    assert catalog.format_semantic_id((1, 9)) == "<p_1><q_9>"


# --- collisions and lookups -----------------------------------------------------------------


def test_collisions_return_all_items_in_catalog_order():
    catalog = small_catalog()
    assert catalog.items_of_semantic_id(0) == ["b", "d"]
    assert catalog.items_of_semantic_id(1) == ["c", "e"]
    assert catalog.items_of_semantic_id(2) == ["a"]


def test_collisions_order_follows_catalog_not_ids():
    # Catalog order differs from sorted id order; collisions must come back in catalog order.
    ids = ["z", "m", "a", "q", "b"]
    codes = [[1, 1], [0, 0], [1, 1], [0, 0], [1, 1]]
    catalog = ItemCatalog.from_codes(ids, codes, 2)
    assert catalog.semantic_ids.tolist() == [[0, 0], [1, 1]]
    assert catalog.items_of_semantic_id(0) == ["m", "q"]
    assert catalog.items_of_semantic_id(1) == ["z", "a", "b"]


def test_items_of_semantic_id_partition_random_catalog():
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 3, size=(200, 3))
    ids = [f"i{k}" for k in rng.permutation(200)]
    catalog = ItemCatalog.from_codes(ids, codes, 3)
    seen = []
    for sid, row in enumerate(catalog.semantic_ids.tolist()):
        expected = [ids[i] for i in range(200) if codes[i].tolist() == row]
        assert catalog.items_of_semantic_id(sid) == expected
        seen += expected
    assert sorted(seen) == sorted(ids)


def test_codes_of():
    catalog = small_catalog()
    assert catalog.codes_of("a") == (3, 1, 7)
    assert catalog.codes_of("d") == (0, 5, 2)
    assert all(isinstance(c, int) for c in catalog.codes_of("a"))
    numeric = ItemCatalog.from_codes([7, 8], [[1], [2]], 3)
    assert numeric.codes_of(8) == (2,)  # looked up by str(item_id)
    with pytest.raises(XgrError, match="unknown item id"):
        catalog.codes_of("nope")


# --- semantic ID text -----------------------------------------------------------------------


def test_format_parse_round_trip():
    catalog = ItemCatalog.from_codes(["p", "q"], [[12, 5, 200], [0, 0, 0]], 256)
    assert catalog.format_semantic_id((12, 5, 200)) == "<a_12><b_5><c_200>"
    assert catalog.format_semantic_id([0, 0, 0]) == "<a_0><b_0><c_0>"
    for row in catalog.semantic_ids.tolist():
        text = catalog.format_semantic_id(row)
        assert catalog.parse_semantic_id(text) == tuple(row)
    assert catalog.parse_semantic_id("<a_12><b_5><c_200>") == (12, 5, 200)


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("<a12><b_5><c_200>", "malformed"),
        ("a_1", "malformed"),
        ("<a_x><b_5><c_200>", "malformed"),
        ("", "malformed"),
        ("<a_12><b_5>junk<c_200>", "malformed"),
        ("<a_12><b_5>", "levels"),
        ("<a_12><b_5><c_200><d_1>", "levels"),
        ("<a_12><c_5><b_200>", "levels"),
        ("<x_12><y_5><z_200>", "levels"),
    ],
)
def test_parse_errors(text, problem):
    catalog = ItemCatalog.from_codes(["p"], [[12, 5, 200]], 256)
    with pytest.raises(XgrError, match=problem):
        catalog.parse_semantic_id(text)


@pytest.mark.parametrize(
    "text",
    [
        "<a_7><b_7><c_7>",  # well formed, codes in range, but no item has this path
        "<a_3><b_1><c_5>",  # a valid 2-level prefix with a leaf no item has
        "<a_99><b_1><c_7>",  # code >= codebook_size
    ],
)
def test_parse_rejects_semantic_id_not_in_catalog(text):
    # Docstring: "raises XgrError unless it names a catalog path".
    # BUG: parse_semantic_id only checks the syntax and the level letters; it returns
    # (7, 7, 7) / (3, 1, 5) / (99, 1, 7) here instead of raising.
    with pytest.raises(XgrError):
        small_catalog().parse_semantic_id(text)


def test_format_wrong_number_of_codes_raises_xgr_error():
    # BUG: raises a bare ValueError from zip(strict=True), not XgrError.
    catalog = small_catalog()
    with pytest.raises(XgrError):
        catalog.format_semantic_id((3, 1))


def test_level_names_that_cannot_round_trip_are_rejected_or_round_trip():
    # BUG: upper-case level letters are accepted, but the text they format cannot be parsed
    # back (nor can the index file to_index_json writes be read by from_index_json).
    try:
        catalog = ItemCatalog.from_codes(["p"], [[1, 2]], 4, level_names=("A", "B"))
    except XgrError:
        return
    assert catalog.parse_semantic_id(catalog.format_semantic_id((1, 2))) == (1, 2)


# --- index file round trip ------------------------------------------------------------------


def test_to_index_json_round_trip(tmp_path):
    catalog = ItemCatalog.from_codes(ITEM_IDS, CODES, 8, level_names=("u", "v", "w"))
    path = tmp_path / "out.json"
    catalog.to_index_json(path)
    raw = json.loads(path.read_text())
    assert list(raw) == ITEM_IDS
    assert raw["a"] == ["<u_3>", "<v_1>", "<w_7>"]
    again = ItemCatalog.from_index_json(path, codebook_size=8)
    assert again.item_ids == catalog.item_ids
    np.testing.assert_array_equal(again.codes, catalog.codes)
    assert again.level_names == catalog.level_names
    assert again.codebook_size == catalog.codebook_size
    assert again.fingerprint == catalog.fingerprint
    assert [again.items_of_semantic_id(s) for s in range(3)] == [
        catalog.items_of_semantic_id(s) for s in range(3)
    ]


# --- fingerprint ----------------------------------------------------------------------------


def test_fingerprint_format_and_stability():
    fp = small_catalog().fingerprint
    assert fp.startswith("sha256:")
    assert len(fp) == len("sha256:") + 64
    int(fp[len("sha256:") :], 16)
    assert small_catalog().fingerprint == fp


def test_fingerprint_ignores_item_order():
    perm = [3, 0, 4, 1, 2]
    shuffled = ItemCatalog.from_codes([ITEM_IDS[i] for i in perm], [CODES[i] for i in perm], 8)
    assert shuffled.item_ids != ITEM_IDS
    assert shuffled.fingerprint == small_catalog().fingerprint


def test_fingerprint_changes_with_one_code_or_one_id():
    base = small_catalog().fingerprint
    for row in range(len(CODES)):
        for level in range(3):
            codes = [list(r) for r in CODES]
            codes[row][level] = (codes[row][level] + 1) % 8
            assert ItemCatalog.from_codes(ITEM_IDS, codes, 8).fingerprint != base
    for row in range(len(ITEM_IDS)):
        ids = list(ITEM_IDS)
        ids[row] = ids[row] + "x"
        assert ItemCatalog.from_codes(ids, CODES, 8).fingerprint != base
    # Swapping the codes of two items (same multiset of rows) also changes it.
    swapped = [CODES[2], CODES[1], CODES[0], CODES[3], CODES[4]]
    assert ItemCatalog.from_codes(ITEM_IDS, swapped, 8).fingerprint != base


def test_fingerprint_distinguishes_ids_containing_separators():
    # BUG (minor): ids and codes are joined with "\t" and "\n" unescaped, so an item id holding
    # those characters can make two different item -> codes maps hash to the same digest.
    two_items = ItemCatalog.from_codes(["x", "y"], [[1, 2], [3, 0]], 4)
    one_item = ItemCatalog.from_codes(["x\t1,2\ny"], [[3, 0]], 4)
    assert two_items.fingerprint != one_item.fingerprint


# --- model metadata -------------------------------------------------------------------------


def test_write_model_metadata(tmp_path):
    catalog = small_catalog()
    path = catalog.write_model_metadata(tmp_path)
    assert path == tmp_path / CATALOG_METADATA_FILE
    assert CATALOG_METADATA_FILE == "xgr_catalog.json"
    meta = json.loads(path.read_text())
    assert meta == {
        "fingerprint": catalog.fingerprint,
        "num_items": 5,
        "num_semantic_ids": 3,
        "num_levels": 3,
        "codebook_size": 8,
        "level_names": ["a", "b", "c"],
        "items": dict(zip(catalog.item_ids, catalog.codes.tolist(), strict=True)),
    }
    table = [[10 + i for i in range(8)], [20 + i for i in range(8)], [30 + i for i in range(8)]]
    assert catalog.write_model_metadata(str(tmp_path), sid_token_ids=table) == path
    assert json.loads(path.read_text())["sid_token_ids"] == table


def test_compatibility_is_by_rule_new_and_removed_items_pass_moved_ones_are_named():
    catalog = small_catalog()
    meta = {
        "num_levels": 3, "codebook_size": 8, "level_names": ["a", "b", "c"],
        "items": dict(zip(catalog.item_ids, catalog.codes.tolist(), strict=True)),
    }  # fmt: skip
    catalog.check_compatible(meta)
    codes = catalog.codes.tolist()
    grown = ItemCatalog.from_codes([*catalog.item_ids[1:], "new1"], [*codes[1:], [7, 7, 7]], 8)
    grown.check_compatible(meta)  # one removed, one added
    moved = ItemCatalog.from_codes(
        catalog.item_ids, [[c[0], c[1], (c[2] + 1) % 8] for c in codes], 8
    )
    with pytest.raises(XgrError, match=rf"other semantic IDs.*'{catalog.item_ids[0]}' \["):
        moved.check_compatible(meta, "the model")
    wider = ItemCatalog.from_codes(catalog.item_ids, codes, 16)
    with pytest.raises(XgrError, match="codebook_size is 16, the model was trained with 8"):
        wider.check_compatible(meta, "the model")
    # A record without items (written before them) needs the very same catalog.
    old = {"fingerprint": catalog.fingerprint}
    catalog.check_compatible(old)
    with pytest.raises(XgrError, match="fingerprint"):
        grown.check_compatible(old)


# --- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "codes", "codebook", "problem"),
    [
        (["p", "q"], [[1, 2], [3]], 4, "ragged"),
        (["p", "q"], [[1, -2], [3, 0]], 4, "negative code in item 'p'"),
        (["p", "q"], [[1, 2], [3, 4]], 4, r"out of range in item 'q'.*codebook_size 4"),
        (["p"], [[0, 1]], 1, "out of range"),
        ([], [], 4, "empty"),
        ([], np.zeros((0, 3), dtype=np.int64), 4, "empty"),
        (["p", "q", "p"], [[0], [1], [2]], 4, "duplicate item id 'p'"),
        ([1, "1"], [[0], [1]], 4, "duplicate item id '1'"),
        (["p", "q"], [[1.0, 2.0], [3.0, 0.0]], 4, "integer"),
        (["p", "q"], np.array([[1.5, 2.0], [3.0, 0.0]]), 4, "integer"),
        (["p", "q"], [[1, "2"], [3, 0]], 4, "integer"),
        (["p", "q"], [[1, None], [3, 0]], 4, "integer"),
        (["p", "q"], [[True, False], [False, True]], 4, "integer"),
        (["p", "q", "r"], np.array([1, 2, 3]), 4, "shape"),
        (["p"], [[0, 1], [1, 0]], 4, "1 item ids for 2 rows"),
    ],
)
def test_from_codes_errors(ids, codes, codebook, problem):
    with pytest.raises(XgrError, match=problem):
        ItemCatalog.from_codes(ids, codes, codebook)


def test_from_codes_level_names_count_error():
    with pytest.raises(XgrError, match="3 level names for 2 levels"):
        ItemCatalog.from_codes(["p"], [[0, 1]], 4, level_names="abc")


def test_from_codes_one_dimensional_list_raises_xgr_error():
    # BUG: a flat list of ints raises TypeError ('int' object is not iterable) from
    # _as_code_array instead of XgrError (the same data as a numpy array gives XgrError).
    with pytest.raises(XgrError):
        ItemCatalog.from_codes(["p", "q", "r"], [1, 2, 3], 4)


@pytest.mark.parametrize(
    ("index", "problem"),
    [
        ({"1": ["<a_1>", "<b_2>"], "2": ["<a_1>"]}, "levels"),  # ragged code lengths
        ({"1": ["<a_1>", "<b_2>"], "2": ["<a_1>", "<c_2>"]}, "levels"),  # letters differ
        ({"1": ["<a_1>", "<b_2>"], "2": ["<b_1>", "<a_2>"]}, "levels"),
        ({"1": ["<a12>", "<b_2>"]}, "malformed code '<a12>'"),
        ({"1": ["a_1", "<b_2>"]}, "malformed code 'a_1'"),
        ({"1": ["<a_x>", "<b_2>"]}, "malformed code '<a_x>'"),
        ({"1": ["<a_-1>", "<b_2>"]}, "malformed"),  # negative code
        ({"1": ["<a_1.5>", "<b_2>"]}, "malformed"),  # non-integer code
        ({"1": [1, 2]}, "malformed code 1"),
        ({"1": "<a_1>junk"}, "malformed semantic ID"),
        ({"1": []}, "expected a list"),
        ({"1": 5}, "expected a list"),
        ({}, "empty"),
        ([["<a_1>"]], "JSON object"),
    ],
)
def test_from_index_json_errors(tmp_path, index, problem):
    path = write_json(tmp_path / "index.json", index)
    with pytest.raises(XgrError, match=problem):
        ItemCatalog.from_index_json(path)


def test_from_index_json_out_of_range_code(tmp_path):
    path = write_json(tmp_path / "index.json", {"1": ["<a_1>"], "2": ["<a_9>"]})
    with pytest.raises(XgrError, match=r"out of range in item '2'.*codebook_size 8"):
        ItemCatalog.from_index_json(path, codebook_size=8)


@pytest.mark.parametrize("text", ['{"1": ["<a_1>"]', "not json", ""])
def test_from_index_json_unreadable(tmp_path, text):
    path = tmp_path / "index.json"
    path.write_text(text)
    with pytest.raises(XgrError, match="cannot read catalog index"):
        ItemCatalog.from_index_json(path)


def test_from_index_json_missing_file_and_directory(tmp_path):
    with pytest.raises(XgrError, match="cannot read catalog index"):
        ItemCatalog.from_index_json(tmp_path / "absent.json")
    with pytest.raises(XgrError, match="cannot read catalog index"):
        ItemCatalog.from_index_json(tmp_path)


def test_from_index_json_non_utf8_raises_xgr_error(tmp_path):
    # BUG: read_text() raises UnicodeDecodeError, which from_index_json does not catch.
    path = tmp_path / "index.json"
    path.write_bytes(b'\xff\xfe{"1": ["<a_1>"]}')
    with pytest.raises(XgrError, match="cannot read catalog index"):
        ItemCatalog.from_index_json(path)


def test_from_index_json_reads_a_utf8_byte_order_mark(tmp_path):
    path = tmp_path / "index.json"
    path.write_bytes(b'\xef\xbb\xbf{"1": ["<a_1>"], "2": ["<a_3>"]}')
    assert ItemCatalog.from_index_json(path).codes.tolist() == [[1], [3]]


def test_from_index_json_duplicate_item_ids_raise(tmp_path):
    # BUG: json.loads keeps only the last of duplicate keys, so the item "1" -> <a_1> is
    # silently dropped instead of raising "duplicate item id".
    path = tmp_path / "index.json"
    path.write_text('{"1": ["<a_1>"], "2": ["<a_3>"], "1": ["<a_2>"]}')
    with pytest.raises(XgrError, match="duplicate item id"):
        ItemCatalog.from_index_json(path)


# --- the real Amazon Industrial_and_Scientific index ----------------------------------------


def test_real_industrial_index():
    if not REAL_INDEX.exists():
        pytest.skip(f"{REAL_INDEX} not found: the shared data folder is absent")
    catalog = ItemCatalog.from_index_json(REAL_INDEX)
    assert len(catalog) == 3686
    assert catalog.num_semantic_ids == 3670
    assert catalog.num_levels == 3
    assert catalog.level_names == ("a", "b", "c")
    assert catalog.codebook_size <= 256
    assert catalog.codes_of("7") == catalog.codes_of("8")
    sid = int(catalog.sid_of_item[catalog.item_index["7"]])
    assert catalog.items_of_semantic_id(sid) == ["7", "8"]
    assert catalog.codes_of("0") == (236, 231, 226)
    assert catalog.format_semantic_id(catalog.codes_of("0")) == "<a_236><b_231><c_226>"
    # Every item is listed under exactly its own semantic ID.
    total = sum(len(catalog.items_of_semantic_id(s)) for s in range(catalog.num_semantic_ids))
    assert total == 3686


def test_huge_or_non_ascii_codes_are_malformed(tmp_path):
    import json as _json

    from xgr import ItemCatalog as _Catalog
    from xgr.core import XgrError as _Error

    for code in ["<a_" + "9" * 5000 + ">", "<a_\u0661>"]:
        path = tmp_path / "index.json"
        path.write_text(_json.dumps({"x": [code]}))
        with pytest.raises(_Error, match="malformed code"):
            _Catalog.from_index_json(path)
    with pytest.raises(_Error, match="codebook_size"):
        _Catalog.from_codes(["x"], [[1]], True)


def test_item_rows_of_semantic_ids_follow_each_ids_catalog_order():
    rng = np.random.default_rng(4)
    codes = rng.integers(0, 3, size=(200, 2))  # 9 semantic IDs: many collisions
    catalog = ItemCatalog.from_codes([f"i{k}" for k in range(200)], codes, 3)
    sids = np.array([4, 0, 4, catalog.num_semantic_ids - 1], dtype=np.int64)
    rows, counts = catalog.item_rows_of_semantic_ids(sids)
    want = [catalog.items_of_semantic_id(int(s)) for s in sids]
    assert counts.tolist() == [len(w) for w in want]
    assert [catalog.item_ids[r] for r in rows.tolist()] == [i for w in want for i in w]


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 200),
    st.integers(1, 6),
    st.sampled_from([1, 2, 7, 16, 256, 1 << 16]),
    st.integers(0, 2**32 - 1),
)
def test_unique_rows_equals_numpy_unique(num, levels, codebook, seed):
    codes = np.random.default_rng(seed).integers(0, codebook, (num, levels))
    rows, inverse = unique_rows(codes, codebook)
    want_rows, want_inverse = np.unique(codes, axis=0, return_inverse=True)
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(inverse, want_inverse.reshape(-1))
    assert rows.dtype == inverse.dtype == np.int64


def test_the_fingerprint_is_the_digest_of_one_json_line_per_item_by_id():
    import hashlib

    ids = ["b", 'q"uote', "back\\slash", "ünï", "a\nline", "", "🙂", "10", "9"]
    codes = np.random.default_rng(3).integers(0, 300, (len(ids), 3))
    catalog = ItemCatalog.from_codes(ids, codes, 300)
    digest = hashlib.sha256(b"xgr-catalog-v1 levels=3\n")
    for row in sorted(range(len(ids)), key=ids.__getitem__):
        digest.update((json.dumps([ids[row], codes[row].tolist()]) + "\n").encode())
    assert catalog.fingerprint == "sha256:" + digest.hexdigest()


def _changed_by_rule(ids, codes, removed_rows, added_ids, added_codes):
    """``ItemCatalog.changed``'s rows, stated directly: removed rows taken by the added items
    in order, the rest appended, or the items past the new end moved, in order, into the
    rows still free."""
    rows = [(i, tuple(c)) for i, c in zip(ids, codes, strict=True)]
    holes = sorted(removed_rows)
    new = list(zip(added_ids, map(tuple, added_codes), strict=True))
    for hole in holes:
        rows[hole] = new.pop(0) if new else None
    rows += new
    size = sum(r is not None for r in rows)
    tail = [r for r in rows[size:] if r is not None]  # in order, into the free rows below
    rows = rows[:size]
    for row in range(size):
        if rows[row] is None:
            rows[row] = tail.pop(0)
    return rows


@settings(max_examples=150, deadline=None)
@given(
    st.integers(1, 30).flatmap(
        lambda n: st.tuples(
            st.just(n),
            st.lists(st.integers(0, n - 1), unique=True, max_size=n),
            st.integers(0, 12),
            st.integers(0, 2**31),
        )
    )
)
def test_changed_keeps_rows_in_place_and_matches_the_rule(case):
    n, removed, num_added, seed = case
    rng = np.random.default_rng(seed)
    catalog = ItemCatalog.from_codes([f"i{k}" for k in range(n)], rng.integers(0, 4, (n, 2)), 4)
    added_ids = [f"new{k}" for k in range(num_added)]
    added_codes = rng.integers(0, 4, (num_added, 2))
    if len(removed) == n and not num_added:
        with pytest.raises(XgrError, match="empty"):
            catalog.changed(np.array(removed), added_ids, added_codes)
        return
    new, source = catalog.changed(np.array(removed, dtype=np.int64), added_ids, added_codes)
    want = _changed_by_rule(catalog.item_ids, catalog.codes, removed, added_ids, added_codes)
    assert list(zip(new.item_ids, map(tuple, new.codes.tolist()), strict=True)) == want
    assert new.item_index == {item: row for row, item in enumerate(new.item_ids)}
    assert [catalog.item_ids[s] if s >= 0 else None for s in source] == [
        None if i.startswith("new") else i for i in new.item_ids
    ]
    # Derived tables as a catalog built from scratch has them.
    direct = ItemCatalog.from_codes(new.item_ids, new.codes, 4)
    np.testing.assert_array_equal(new.semantic_ids, direct.semantic_ids)
    np.testing.assert_array_equal(new.sid_of_item, direct.sid_of_item)
    for sid in range(direct.num_semantic_ids):
        assert new.items_of_semantic_id(sid) == direct.items_of_semantic_id(sid)
    assert new.fingerprint == direct.fingerprint
    # The original is unchanged.
    assert catalog.item_index == {f"i{k}": k for k in range(n)} and len(catalog) == n
