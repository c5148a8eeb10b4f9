"""Semantic IDs for the demo: collaborative item embeddings quantized by residual k-means.

What it does, exactly:

1. Item embeddings. From the training sequences, build the binary user x item matrix
   ``X`` (1 where the user interacted with the item, however often). Each user row is
   scaled by ``1 / sqrt(number of items of the user)`` so that heavy users do not dominate
   the co-occurrence structure. A truncated SVD (sklearn ``TruncatedSVD``, randomized,
   fixed ``random_state``) of the item x user matrix ``X.T`` gives each item the vector
   ``U * S`` of ``embedding_dim`` components; every vector is then L2-normalized (items
   without any interaction keep the zero vector). Two items are close when the same
   users consumed them, i.e. the embedding factorizes the item-item co-occurrence matrix
   ``X.T @ X``.
2. Residual k-means. Level 1 runs k-means with ``codebook_size`` clusters (sklearn
   ``KMeans``, k-means++ init, ``n_init`` restarts, fixed ``random_state``) on the
   embeddings; an item's level-1 code is its cluster. The residual (embedding minus its
   centroid) is clustered the same way for level 2, and so on for every level. One
   codebook is shared by all items at each level, so level-2 codes mean the same offset
   whatever the level-1 code is.
3. Collisions, items whose codes are equal on every level, are kept: the catalog maps one
   semantic ID to all its items. No extra deduplication level is added.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence

import numpy as np
import scipy.sparse as sp
from sklearn.cluster import KMeans
from sklearn.decomposition import TruncatedSVD

from xgr.core import XgrError


def item_embeddings(
    sequences: Iterable[Sequence[str]],
    item_ids: Sequence[str],
    embedding_dim: int = 64,
    seed: int = 0,
) -> np.ndarray:
    """Collaborative item embeddings from co-occurrence (step 1 of the module docstring).

    Args:
        sequences: per user, the item ids consumed (order is ignored).
        item_ids: the items to embed, defining the row order; items of ``sequences`` not
            listed here are ignored.
        embedding_dim: SVD components (>= 1 and < the number of users and of items).
        seed: random_state of the randomized SVD.

    Returns:
        float32 array (len(item_ids), embedding_dim), rows of unit L2 norm (zero for items
        no user consumed).

    Raises:
        XgrError: no interactions, or embedding_dim out of range.
    """
    index = {item: row for row, item in enumerate(item_ids)}
    rows, cols = [], []
    for user, seq in enumerate(sequences):
        for item in set(seq):
            if item in index:
                rows.append(user)
                cols.append(index[item])
    if not rows:
        raise XgrError("no interactions with catalog items: cannot embed items")
    num_users = max(rows) + 1
    matrix = sp.csr_matrix(
        (np.ones(len(rows), dtype=np.float64), (rows, cols)), shape=(num_users, len(item_ids))
    )
    counts = np.asarray(matrix.sum(axis=1)).ravel()
    matrix = sp.diags(1.0 / np.sqrt(np.maximum(counts, 1.0))) @ matrix
    if not 1 <= embedding_dim < min(matrix.shape):
        raise XgrError(
            f"embedding_dim must be in [1, {min(matrix.shape)}) for a {matrix.shape} "
            f"user x item matrix, got {embedding_dim}"
        )
    svd = TruncatedSVD(n_components=embedding_dim, algorithm="randomized", random_state=seed)
    vectors = svd.fit_transform(matrix.T.tocsr())
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def residual_kmeans(
    embeddings: np.ndarray,
    num_levels: int = 3,
    codebook_size: int = 32,
    seed: int = 0,
    n_init: int = 4,
) -> np.ndarray:
    """Quantize embeddings into ``num_levels`` codes (step 2 of the module docstring).

    Args:
        embeddings: float array (num_items, dim).
        num_levels: code levels (>= 1).
        codebook_size: clusters per level (>= 1 and <= num_items).
        seed: random_state of every KMeans (level ``l`` uses ``seed + l``).
        n_init: k-means++ restarts per level; the best inertia wins.

    Returns:
        int64 array (num_items, num_levels), every code in [0, codebook_size).

    Raises:
        XgrError: bad shape or sizes.
    """
    data = np.asarray(embeddings, dtype=np.float64)
    if data.ndim != 2 or data.shape[0] == 0:
        raise XgrError(f"embeddings must have shape (num_items, dim), got {data.shape}")
    if num_levels < 1:
        raise XgrError(f"num_levels must be >= 1, got {num_levels}")
    if not 1 <= codebook_size <= data.shape[0]:
        raise XgrError(f"codebook_size must be in [1, {data.shape[0]}], got {codebook_size}")
    codes = np.zeros((data.shape[0], num_levels), dtype=np.int64)
    residual = data.copy()
    for level in range(num_levels):
        kmeans = KMeans(n_clusters=codebook_size, n_init=n_init, random_state=seed + level)
        with warnings.catch_warnings():
            # Deep levels can have fewer distinct residuals than clusters; that is harmless.
            warnings.simplefilter("ignore")
            labels = kmeans.fit_predict(residual)
        codes[:, level] = labels
        residual = residual - kmeans.cluster_centers_[labels]
    return codes


def semantic_ids(
    sequences: Iterable[Sequence[str]],
    item_ids: Sequence[str],
    num_levels: int = 3,
    codebook_size: int = 32,
    embedding_dim: int = 64,
    seed: int = 0,
) -> np.ndarray:
    """Semantic IDs of ``item_ids`` from the users' ``sequences`` (the whole module docstring).

    Returns:
        int64 array (len(item_ids), num_levels) of codes in [0, codebook_size); the same
        inputs give the same codes.

    Raises:
        XgrError: as ``item_embeddings`` and ``residual_kmeans``.
    """
    vectors = item_embeddings(sequences, item_ids, embedding_dim, seed)
    return residual_kmeans(vectors, num_levels, codebook_size, seed)
