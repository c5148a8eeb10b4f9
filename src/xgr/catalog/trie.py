"""The catalog's valid semantic-ID paths as a prefix trie stored in tensors.

Nodes at depth ``d`` are the distinct length-``d`` prefixes of the catalog's semantic IDs,
numbered in lexicographic order; depth 0 holds the root (node 0) and depth ``num_levels``
holds the distinct semantic IDs themselves. Because numbering follows lexicographic order,
the children of one node are contiguous, so a level's children need no id table: a child's
position in the level's sorted child list *is* its node id at the next depth.

Each level (depth ``d`` -> ``d + 1``) is stored in one of two layouts, chosen once at build:

- dense: ``child_table`` of shape (num_parents, codebook_size), int32, the child node id
  for each code or -1 (a gather gives validity and next node at once; used while small);
- CSR: ``row_ptr`` of shape (num_parents + 1,) into ``child_code`` of shape (num_children,),
  codes sorted within each parent (used where a dense table would be large).

``expand`` turns a batch of node ids into padded candidate lists with no host sync and no
Python per node, on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# A level is stored densely while its child table stays under this many entries (int32: 16 MiB).
DENSE_TABLE_MAX_ENTRIES = 4 * 1024 * 1024


@dataclass(frozen=True)
class TrieLevel:
    """One level of the trie: the children of every node at depth ``d``.

    Attributes:
        num_parents: nodes at depth d.
        num_children: nodes at depth d + 1.
        max_children: the largest number of children of one node (the candidate width).
        child_table: dense layout, (num_parents, codebook_size) int32, child id or -1; or None.
        row_ptr: CSR layout, (num_parents + 1,) int64; or None.
        child_code: CSR layout, (num_children,) int64 code of each child; or None.
        child_parent: (num_children,) int64 parent node of each child (either layout): how
            a per-request mask of the children reaches their parents.
    """

    num_parents: int
    num_children: int
    max_children: int
    child_table: torch.Tensor | None
    row_ptr: torch.Tensor | None
    child_code: torch.Tensor | None
    child_parent: torch.Tensor | None = None

    @property
    def is_dense(self) -> bool:
        return self.child_table is not None

    @property
    def width(self) -> int:
        """Candidates per node returned by ``expand``: codebook size if dense, else max_children."""
        return self.child_table.shape[1] if self.child_table is not None else self.max_children

    def expand(self, nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Valid continuations of each node.

        Args:
            nodes: (N,) int64 node ids at depth d (any value for rows whose mask is False later).

        Returns:
            codes: (N, W) int64 code of each candidate.
            children: (N, W) int64 child node id at depth d + 1.
            valid: (N, W) bool, True where the candidate is a real child; codes and
                children of invalid slots are arbitrary in-range values, to be masked.
        """
        nodes = nodes.clamp(0, self.num_parents - 1)
        if self.child_table is not None:
            child = self.child_table[nodes].long()
            valid = child >= 0
            width = self.child_table.shape[1]
            codes = torch.arange(width, device=nodes.device).expand(nodes.shape[0], width)
            return codes, child.clamp(min=0), valid
        start = self.row_ptr[nodes]
        end = self.row_ptr[nodes + 1]
        idx = start[:, None] + torch.arange(self.max_children, device=nodes.device)[None, :]
        valid = idx < end[:, None]
        idx = idx.clamp(max=self.num_children - 1)
        return self.child_code[idx], idx, valid

    def to(self, device: torch.device | str) -> TrieLevel:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return TrieLevel(
            self.num_parents,
            self.num_children,
            self.max_children,
            move(self.child_table),
            move(self.row_ptr),
            move(self.child_code),
            move(self.child_parent),
        )


@dataclass(frozen=True)
class PrefixTrie:
    """All levels of the valid-path trie; the leaves are semantic-ID indices.

    Attributes:
        levels: one ``TrieLevel`` per code level; ``levels[-1]`` children are semantic IDs,
            numbered as ``ItemCatalog.semantic_ids`` rows.
        codebook_size: codes per level.
    """

    levels: tuple[TrieLevel, ...]
    codebook_size: int

    @property
    def device(self) -> torch.device:
        first = self.levels[0]
        tensor = first.child_table if first.child_table is not None else first.row_ptr
        return tensor.device

    def to(self, device: torch.device | str) -> PrefixTrie:
        return PrefixTrie(tuple(level.to(device) for level in self.levels), self.codebook_size)


def build_prefix_trie(
    semantic_ids: np.ndarray,
    codebook_size: int,
    dense_max_entries: int = DENSE_TABLE_MAX_ENTRIES,
) -> PrefixTrie:
    """Build the trie of a catalog's distinct semantic IDs.

    Args:
        semantic_ids: (num_sids, num_levels) int64, distinct rows sorted lexicographically.
        codebook_size: codes per level (every code is < codebook_size).
        dense_max_entries: a level is dense when num_parents * codebook_size <= this.

    Returns:
        The trie on the CPU.
    """
    num_sids, num_levels = semantic_ids.shape
    # node_at_depth[d][s]: the depth-d node on the path of semantic ID s.
    node_at_depth = [np.zeros(num_sids, dtype=np.int64)]
    for depth in range(1, num_levels + 1):
        prefix = semantic_ids[:, :depth]
        starts = np.ones(num_sids, dtype=bool)
        starts[1:] = np.any(prefix[1:] != prefix[:-1], axis=1)
        node_at_depth.append(np.cumsum(starts) - 1)

    levels = []
    for depth in range(num_levels):
        parents, children = node_at_depth[depth], node_at_depth[depth + 1]
        num_parents, num_children = int(parents[-1]) + 1, int(children[-1]) + 1
        first_sid = np.searchsorted(children, np.arange(num_children))
        child_parent = parents[first_sid]
        child_code = semantic_ids[first_sid, depth]
        row_ptr = np.searchsorted(child_parent, np.arange(num_parents + 1))
        max_children = int(np.max(np.diff(row_ptr)))
        parent_of = torch.from_numpy(child_parent.astype(np.int64))
        if num_parents * codebook_size <= dense_max_entries:
            table = np.full((num_parents, codebook_size), -1, dtype=np.int32)
            table[child_parent, child_code] = np.arange(num_children, dtype=np.int32)
            levels.append(
                TrieLevel(
                    num_parents,
                    num_children,
                    max_children,
                    torch.from_numpy(table),
                    None,
                    None,
                    parent_of,
                )  # fmt: skip
            )
        else:
            levels.append(
                TrieLevel(
                    num_parents,
                    num_children,
                    max_children,
                    None,
                    torch.from_numpy(row_ptr.astype(np.int64)),
                    torch.from_numpy(child_code.astype(np.int64)),
                    parent_of,
                )
            )
    return PrefixTrie(tuple(levels), codebook_size)
