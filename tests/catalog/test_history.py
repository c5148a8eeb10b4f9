"""Resolving history entries (item ids, semantic IDs, titles) into catalog items."""

import re

import numpy as np
import pytest

from xgr import ItemCatalog
from xgr.catalog import resolve_history
from xgr.core import XgrError

TITLES = {
    "127": "Godfather, The (1972)",
    "187": "Godfather: Part II, The (1974)",
    "50": "Star Wars (1977)",
    "246": "Chasing Amy (1997)",
    "1401": "Chasing Amy (1997)",
}


@pytest.fixture
def catalog():
    codes = np.arange(15).reshape(5, 3) % 4
    codes[4] = codes[1]  # "1401" shares "187"'s semantic ID
    return ItemCatalog.from_codes(list(TITLES), codes, codebook_size=4)


def test_titles_ids_and_case(catalog):
    entries = [
        "Godfather, The (1972)",
        "50",
        246,
        "  star wars (1977) ",
        "GODFATHER: PART II, THE (1974)",
    ]
    resolved = resolve_history(catalog, entries, TITLES)
    assert resolved.item_ids == ["127", "50", "246", "50", "187"]
    assert resolved.excluded == {"127", "50", "246", "187"}


def test_semantic_id_stands_for_all_its_items(catalog):
    sid = catalog.format_semantic_id(catalog.codes_of("187"))
    resolved = resolve_history(catalog, [sid])
    assert resolved.item_ids == ["187"]
    assert resolved.excluded == {"187", "1401"}


def test_duplicate_title_takes_first_catalog_item_and_excludes_all(catalog):
    for entry in ("Chasing Amy (1997)", " chasing  AMY (1997)"):
        resolved = resolve_history(catalog, [entry], TITLES)
        assert resolved.item_ids == ["246"]
        assert resolved.excluded == {"246", "1401"}
    # An item id stands for that item alone.
    assert resolve_history(catalog, ["1401"], TITLES).excluded == {"1401"}


def test_titles_need_a_title_map(catalog):
    with pytest.raises(XgrError, match=re.escape("unknown items in history: 'Star Wars (1977)'")):
        resolve_history(catalog, ["Star Wars (1977)"])


def test_every_unknown_entry_is_named_with_close_titles(catalog):
    entries = ["Star Wars (1977)", "Godfather (1972)", "<a_3><b_3><c_3>", "<a_1>"]
    with pytest.raises(XgrError) as err:
        resolve_history(catalog, entries, TITLES)
    message = str(err.value)
    assert "unknown items in history: 'Godfather (1972)', '<a_3><b_3><c_3>', '<a_1>'" in message
    assert "'Godfather, The (1972)'" in message


def test_unknown_without_close_match_explains_format(catalog):
    with pytest.raises(XgrError, match="titles with their year"):
        resolve_history(catalog, ["zzzzzzzz"], TITLES)


def test_items_outside_the_catalog_are_unknown(catalog):
    titles = {**TITLES, "999": "Not In Catalog (2000)"}
    with pytest.raises(XgrError, match="unknown items"):
        resolve_history(catalog, ["Not In Catalog (2000)"], titles)


def test_many_unknown_entries_are_counted(catalog):
    with pytest.raises(XgrError, match="and 5 more"):
        resolve_history(catalog, [f"x{i}" for i in range(25)])


def test_title_starting_with_angle_bracket(catalog):
    titles = {**TITLES, "50": "<3 Love (2001)"}
    assert resolve_history(catalog, ["<3 Love (2001)"], titles).item_ids == ["50"]


def test_huge_codes_in_entries_are_unknown_not_crashes(catalog):
    with pytest.raises(XgrError, match="unknown items"):
        resolve_history(catalog, ["<a_" + "9" * 5000 + "><b_1><c_1>"])


@pytest.mark.parametrize(
    ("history", "message"),
    [
        ("12", "got the string '12'"),
        (7, "got int"),
        ({"1", "2"}, "not a set"),
        (np.array(1), r"array of shape \(\)"),
        (np.array([[1, 2]]), r"array of shape \(1, 2\)"),
    ],
    ids=["string", "int", "set", "0-d array", "2-d array"],
)
def test_history_that_is_not_a_list_is_refused(catalog, history, message):
    with pytest.raises(XgrError, match=message):
        resolve_history(catalog, history)


def test_history_arrays_are_read_as_their_items(catalog):
    import torch

    for history in (np.array([127, 50]), torch.tensor([127, 50])):
        assert resolve_history(catalog, history).item_ids == ["127", "50"]
