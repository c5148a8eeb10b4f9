import pytest

from xgr.core import XgrError
from xgr.demo.movielens import MovieLensData, leave_one_out, parse_interactions, parse_items

INTER = (
    "user_id:token\titem_id:token\trating:float\ttimestamp:float\n"
    "10\t5\t3\t300\n"
    "2\t7\t4\t100\n"
    "10\t6\t1\t100\n"
    "10\t9\t5\t300\n"  # same second as item 5: file order decides
    "10\t8\t2\t200\n"
    "2\t1\t4\t50\n"
)
ITEMS = (
    "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
    "127\tGodfather, The\t1972\tAction Crime Drama\n"
    "50\tStar Wars\t1977\tAction Sci-Fi\n"
    "267\tunkonwn\tunkonwn\tunknown\n"
)


def test_sequences_are_time_ordered_with_stable_ties():
    sequences = parse_interactions(INTER)
    assert list(sequences) == ["2", "10"]  # numeric user order
    assert sequences["10"] == ["6", "8", "5", "9"]
    assert sequences["2"] == ["1", "7"]


def test_titles_with_and_without_year():
    titles = parse_items(ITEMS)
    assert titles == {"127": "Godfather, The (1972)", "50": "Star Wars (1977)", "267": "unkonwn"}


def test_bad_header_raises():
    with pytest.raises(XgrError, match="expected header"):
        parse_interactions("user\titem\n1\t2\n")
    with pytest.raises(XgrError, match="bad timestamp"):
        parse_interactions(INTER.replace("\t300\n", "\tsoon\n", 1))


def test_leave_one_out_holds_out_last_item():
    data = MovieLensData(
        sequences={"1": ["a", "b", "c"], "2": ["d"], "3": ["e", "f"]}, titles={}, item_ids=[]
    )
    split = leave_one_out(data)
    assert split.users == ["1", "3"]
    assert split.histories == [["a", "b"], ["e"]]
    assert split.targets == ["c", "f"]
