"""The prefix trie against a brute-force set of valid prefixes, in dense and CSR layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from xgr import ItemCatalog
from xgr.catalog import PrefixTrie, build_prefix_trie

DENSE = 1 << 62  # every level dense
CSR = 0  # every level CSR


def brute_force_levels(semantic_ids: np.ndarray) -> list[dict[int, set[tuple[int, int]]]]:
    """For each depth d: node id -> {(code, child node id)}, nodes numbered lexicographically."""
    rows = [tuple(r) for r in semantic_ids.tolist()]
    num_levels = len(rows[0])
    prefixes = [sorted({r[:d] for r in rows}) for d in range(num_levels + 1)]
    node_id = [{p: i for i, p in enumerate(level)} for level in prefixes]
    levels = []
    for d in range(num_levels):
        children: dict[int, set[tuple[int, int]]] = {i: set() for i in range(len(prefixes[d]))}
        for child in prefixes[d + 1]:
            children[node_id[d][child[:d]]].add((child[d], node_id[d + 1][child]))
        levels.append(children)
    return levels


def expanded_pairs(level, nodes: torch.Tensor) -> list[list[tuple[int, int]]]:
    codes, children, valid = level.expand(nodes)
    assert codes.shape == children.shape == valid.shape == (nodes.shape[0], level.width)
    assert codes.dtype == children.dtype == torch.int64
    assert valid.dtype == torch.bool
    return [
        [(int(c), int(n)) for c, n, ok in zip(cs, ns, vs, strict=True) if ok]
        for cs, ns, vs in zip(codes, children, valid, strict=True)
    ]


def check_trie(catalog: ItemCatalog, dense_max_entries: int) -> PrefixTrie:
    sids = catalog.semantic_ids
    trie = build_prefix_trie(sids, catalog.codebook_size, dense_max_entries=dense_max_entries)
    expected = brute_force_levels(sids)
    assert len(trie.levels) == catalog.num_levels
    assert trie.codebook_size == catalog.codebook_size
    assert trie.device == torch.device("cpu")
    for d, level in enumerate(trie.levels):
        num_parents = len(expected[d])
        num_children = sum(len(v) for v in expected[d].values())
        assert level.num_parents == num_parents
        assert level.num_children == num_children
        assert level.max_children == max(len(v) for v in expected[d].values())
        assert level.is_dense == (num_parents * catalog.codebook_size <= dense_max_entries)
        if level.is_dense:
            assert level.width == catalog.codebook_size
            assert level.child_table.shape == (num_parents, catalog.codebook_size)
            assert level.row_ptr is None and level.child_code is None
        else:
            assert level.width == level.max_children
            assert level.child_table is None
            assert level.row_ptr.shape == (num_parents + 1,)
            assert level.child_code.shape == (num_children,)
        # Every node at once, then a shuffled batch with repeats.
        pairs = expanded_pairs(level, torch.arange(num_parents))
        for node in range(num_parents):
            assert set(pairs[node]) == expected[d][node], (d, node)
            assert len(pairs[node]) == len(expected[d][node])  # no duplicates
            codes = [c for c, _ in pairs[node]]
            assert codes == sorted(codes)  # candidates in code order
        batch = torch.randint(0, num_parents, (2 * num_parents + 3,))
        for node, got in zip(batch.tolist(), expanded_pairs(level, batch), strict=True):
            assert set(got) == expected[d][node]
        assert level.expand(torch.zeros(0, dtype=torch.int64))[2].shape == (0, level.width)
    # Walking an item's codes from the root reaches its semantic ID's row.
    for row, codes in enumerate(catalog.codes.tolist()):
        node = 0
        for d, code in enumerate(codes):
            (pairs,) = expanded_pairs(trie.levels[d], torch.tensor([node]))
            nxt = [child for c, child in pairs if c == code]
            assert len(nxt) == 1
            node = nxt[0]
        assert node == catalog.sid_of_item[row]
        assert catalog.semantic_ids[node].tolist() == codes
    return trie


def check_to_cpu(trie: PrefixTrie) -> None:
    moved = trie.to("cpu")
    assert isinstance(moved, PrefixTrie)
    assert moved.codebook_size == trie.codebook_size
    assert moved.device == torch.device("cpu")
    assert len(moved.levels) == len(trie.levels)
    for a, b in zip(trie.levels, moved.levels, strict=True):
        assert (a.num_parents, a.num_children, a.max_children, a.is_dense, a.width) == (
            b.num_parents,
            b.num_children,
            b.max_children,
            b.is_dense,
            b.width,
        )
        for name in ("child_table", "row_ptr", "child_code"):
            ta, tb = getattr(a, name), getattr(b, name)
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert ta.dtype == tb.dtype
                assert torch.equal(ta, tb)
        nodes = torch.arange(a.num_parents)
        for x, y in zip(a.expand(nodes), b.expand(nodes), strict=True):
            assert torch.equal(x, y)


@st.composite
def random_catalogs(draw) -> ItemCatalog:
    num_levels = draw(st.integers(1, 4))
    codebook = draw(st.integers(1, 6))
    code = st.integers(0, codebook - 1)
    rows = draw(
        st.lists(st.lists(code, min_size=num_levels, max_size=num_levels), min_size=1, max_size=40)
    )
    extra = draw(st.integers(0, 3))  # unused codes at the top of the codebook
    return ItemCatalog.from_codes([f"i{k}" for k in range(len(rows))], rows, codebook + extra)


@settings(max_examples=60, deadline=None)
@given(catalog=random_catalogs())
def test_dense_trie_matches_brute_force(catalog):
    trie = check_trie(catalog, DENSE)
    assert all(level.is_dense for level in trie.levels)
    check_to_cpu(trie)


@settings(max_examples=60, deadline=None)
@given(catalog=random_catalogs())
def test_csr_trie_matches_brute_force(catalog):
    trie = check_trie(catalog, CSR)
    assert not any(level.is_dense for level in trie.levels)
    check_to_cpu(trie)


@settings(max_examples=30, deadline=None)
@given(catalog=random_catalogs(), threshold=st.integers(0, 60))
def test_mixed_layout_trie_matches_brute_force(catalog, threshold):
    check_trie(catalog, threshold)


FIXED = {
    "single_item": ([[2, 0, 1]], 3),
    "one_level": ([[4], [0], [4], [2]], 5),
    "full_binary": ([[a, b, c] for a in range(2) for b in range(2) for c in range(2)], 2),
    "collisions_and_chain": ([[1, 1, 1], [1, 1, 1], [1, 1, 0], [0, 3, 2], [1, 2, 3]], 4),
}


@pytest.mark.parametrize("layout", [DENSE, CSR, 4])
@pytest.mark.parametrize("name", sorted(FIXED))
def test_fixed_catalogs(name, layout):
    rows, codebook = FIXED[name]
    catalog = ItemCatalog.from_codes([str(i) for i in range(len(rows))], rows, codebook)
    trie = check_trie(catalog, layout)
    check_to_cpu(trie)


def test_fixed_example_explicit_values():
    rows = [[1, 1, 1], [1, 1, 0], [0, 3, 2], [1, 2, 3]]
    catalog = ItemCatalog.from_codes(list("abcd"), rows, 4)
    assert catalog.semantic_ids.tolist() == [[0, 3, 2], [1, 1, 0], [1, 1, 1], [1, 2, 3]]
    for layout in (DENSE, CSR):
        trie = build_prefix_trie(catalog.semantic_ids, 4, dense_max_entries=layout)
        assert [lv.num_parents for lv in trie.levels] == [1, 2, 3]
        assert [lv.num_children for lv in trie.levels] == [2, 3, 4]
        assert [lv.max_children for lv in trie.levels] == [2, 2, 2]
        # Root: code 0 -> node 0 (prefix (0,)), code 1 -> node 1 (prefix (1,)).
        assert expanded_pairs(trie.levels[0], torch.tensor([0])) == [[(0, 0), (1, 1)]]
        # Depth 1: (0,) -> (0,3) = node 0; (1,) -> (1,1) = node 1, (1,2) = node 2.
        assert expanded_pairs(trie.levels[1], torch.tensor([1, 0])) == [[(1, 1), (2, 2)], [(3, 0)]]
        # Depth 2: (1,1) -> (1,1,0) = sid 1, (1,1,1) = sid 2; (1,2) -> (1,2,3) = sid 3.
        assert expanded_pairs(trie.levels[2], torch.tensor([0, 1, 2])) == [
            [(2, 0)],
            [(0, 1), (1, 2)],
            [(3, 3)],
        ]


def test_catalog_trie_property_is_the_built_trie():
    rng = np.random.default_rng(3)
    catalog = ItemCatalog.from_codes(
        [str(i) for i in range(300)], rng.integers(0, 5, size=(300, 3)), 5
    )
    trie = catalog.trie
    assert trie is catalog.trie  # cached
    expected = build_prefix_trie(catalog.semantic_ids, catalog.codebook_size)
    for a, b in zip(trie.levels, expected.levels, strict=True):
        assert torch.equal(a.child_table, b.child_table)
    check_trie(catalog, DENSE)
    check_trie(catalog, CSR)
