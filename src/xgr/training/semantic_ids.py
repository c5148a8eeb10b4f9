"""Semantic IDs: item embeddings quantized by residual k-means (RQ-KMeans).

What it does, exactly:

1. Item embeddings. From the training sequences, build the binary user x item matrix
   ``X`` (1 where the user interacted with the item, however often). Each user row is
   scaled by ``1 / sqrt(number of items of the user)`` so that heavy users do not dominate
   the co-occurrence structure. A truncated SVD (sklearn ``TruncatedSVD``, randomized,
   fixed ``random_state``) of the item x user matrix ``X.T`` gives each item the vector
   ``U * S`` of ``embedding_dim`` components; every vector is then L2-normalized (items
   without any interaction keep the zero vector). Two items are close when the same
   users consumed them, i.e. the embedding factorizes the item-item co-occurrence matrix
   ``X.T @ X``. Embeddings may also come from a file (``load_embeddings``).
2. Residual k-means. Level 1 runs k-means with ``codebook_size`` clusters (sklearn
   ``KMeans``, k-means++ init, ``n_init`` restarts, fixed ``random_state``) on the
   embeddings; an item's level-1 code is its cluster. The residual (embedding minus its
   centroid) is clustered the same way for level 2, and so on for every level. One
   codebook is shared by all items at each level, so level-2 codes mean the same offset
   whatever the level-1 code is. ``backend="faiss"`` runs faiss's k-means instead of
   scikit-learn's (faster on large catalogs). ``balanced=True`` caps every cluster at
   ``ceil(items / codebook_size)`` items (``balanced_kmeans``), so that codes are used
   evenly, as OneRec's RQ-Kmeans does.
3. Collisions, items whose codes are equal on every level, are kept by default: the
   catalog maps one semantic ID to all its items. ``separate_collisions`` instead appends a
   level that numbers the items of each semantic ID 0, 1, ... in catalog order (TIGER,
   Rajput et al. 2023), so every item has its own ID.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.cluster import KMeans
from sklearn.decomposition import TruncatedSVD

from xgr.catalog import ItemCatalog
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


BACKENDS = ("sklearn", "faiss")


def residual_kmeans(
    embeddings: np.ndarray,
    num_levels: int = 3,
    codebook_size: int = 32,
    seed: int = 0,
    n_init: int = 4,
    backend: str = "sklearn",
    balanced: bool = False,
) -> np.ndarray:
    """Quantize embeddings into ``num_levels`` codes (step 2 of the module docstring).

    Args:
        embeddings: float array (num_items, dim).
        num_levels: code levels (>= 1).
        codebook_size: clusters per level (>= 1 and <= num_items).
        seed: random seed of every k-means (level ``l`` uses ``seed + l``).
        n_init: k-means restarts per level; the best inertia wins.
        backend: "sklearn" (``KMeans``, k-means++ init) or "faiss" (``faiss.Kmeans``, the
            faiss-cpu package).
        balanced: cap every cluster at ``ceil(num_items / codebook_size)`` items
            (``balanced_kmeans``, started from the backend's centroids).

    Returns:
        int64 array (num_items, num_levels), every code in [0, codebook_size).

    Raises:
        XgrError: bad shape, sizes or backend, non-finite values, or faiss not installed.
    """
    data = np.asarray(embeddings, dtype=np.float64)
    if data.ndim != 2 or data.shape[0] == 0 or data.shape[1] == 0:
        raise XgrError(f"embeddings must have shape (num_items, dim), got {data.shape}")
    if not np.isfinite(data).all():
        row = int(np.argwhere(~np.isfinite(data))[0][0])
        raise XgrError(f"embedding row {row} holds NaN or infinity")
    if num_levels < 1:
        raise XgrError(f"num_levels must be >= 1, got {num_levels}")
    if not 1 <= codebook_size <= data.shape[0]:
        raise XgrError(f"codebook_size must be in [1, {data.shape[0]}], got {codebook_size}")
    if backend not in BACKENDS:
        raise XgrError(f"unknown k-means backend {backend!r}: use one of {list(BACKENDS)}")
    codes = np.zeros((data.shape[0], num_levels), dtype=np.int64)
    residual = data.copy()
    for level in range(num_levels):
        cluster = _faiss_kmeans if backend == "faiss" else _sklearn_kmeans
        labels, centroids = cluster(residual, codebook_size, seed + level, n_init)
        if balanced:
            labels, centroids = balanced_kmeans(residual, centroids)
        codes[:, level] = labels
        residual = residual - centroids[labels]
    return codes


def _sklearn_kmeans(data, k, seed, n_init) -> tuple[np.ndarray, np.ndarray]:
    kmeans = KMeans(n_clusters=k, n_init=n_init, random_state=seed)
    with warnings.catch_warnings():
        # Deep levels can have fewer distinct residuals than clusters; that is harmless.
        warnings.simplefilter("ignore")
        labels = kmeans.fit_predict(data)
    return labels, kmeans.cluster_centers_


def _faiss_kmeans(data, k, seed, n_init) -> tuple[np.ndarray, np.ndarray]:
    try:
        import faiss
    except ImportError:
        raise XgrError(
            "the faiss backend needs the faiss-cpu package (pip install 'xgr[train]'); "
            "or use the sklearn backend"
        ) from None
    points = np.ascontiguousarray(data, dtype=np.float32)
    # Every point trains (faiss samples 256 per centroid by default), and the fewer points
    # than 39 per centroid that small catalogs have are not warned about.
    kmeans = faiss.Kmeans(
        points.shape[1], k, niter=25, nredo=n_init, seed=seed, verbose=False,
        max_points_per_centroid=max(256, -(-len(points) // k)), min_points_per_centroid=1,
    )  # fmt: skip
    kmeans.train(points)
    _, labels = kmeans.index.search(points, 1)
    return labels[:, 0].astype(np.int64), kmeans.centroids.astype(np.float64)


def balanced_kmeans(
    data: np.ndarray, centroids: np.ndarray, iterations: int = 10, candidates: int = 16
) -> tuple[np.ndarray, np.ndarray]:
    """K-means with every cluster capped at ``ceil(num_items / k)`` items.

    Each iteration assigns items greedily, most confident first (the largest gap between the
    nearest and the second nearest centroid), each to its nearest centroid with room left;
    then every centroid moves to the mean of its items. The exact capacity-constrained
    assignment is a min-cost flow (Malinen & Franti 2014, "Balanced K-Means for
    Clustering"); the greedy one is its usual approximation, linear in the items.

    Args:
        data: float64 (num_items, dim) points.
        centroids: float64 (k, dim) starting centroids (an ordinary k-means's).
        iterations: assignment and update rounds.
        candidates: nearest centroids kept per item; an item whose candidates are all full
            takes the nearest centroid with room left.

    Returns:
        int64 (num_items,) labels, no cluster holding more than the cap, and float64 (k, dim)
        centroids (a cluster left empty keeps its previous centroid).
    """
    num, k = len(data), len(centroids)
    cap = -(-num // k)
    centroids = centroids.copy()
    labels = np.zeros(num, dtype=np.int64)
    width = min(candidates, k)
    for _ in range(iterations):
        dist = _squared_distances(data, centroids)
        near = np.argpartition(dist, width - 1, axis=1)[:, :width] if width < k else None
        if near is None:
            near = np.broadcast_to(np.arange(k), (num, k))
        near_dist = np.take_along_axis(dist, near, axis=1)
        order_in_row = np.argsort(near_dist, axis=1)
        near = np.take_along_axis(near, order_in_row, axis=1)
        near_dist = np.take_along_axis(near_dist, order_in_row, axis=1)
        gap = near_dist[:, 1] - near_dist[:, 0] if width > 1 else -near_dist[:, 0]
        fill = np.zeros(k, dtype=np.int64)
        for item in np.argsort(-gap, kind="stable"):
            for cluster in near[item]:
                if fill[cluster] < cap:
                    break
            else:  # every candidate is full: the nearest cluster with room
                open_ = np.flatnonzero(fill < cap)
                cluster = open_[np.argmin(dist[item, open_])]
            labels[item] = cluster
            fill[cluster] += 1
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, data)
        filled = fill > 0
        centroids[filled] = sums[filled] / fill[filled, None]
    return labels, centroids


def _squared_distances(data: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    return (
        (data * data).sum(1, keepdims=True)
        - 2.0 * data @ centroids.T
        + (centroids * centroids).sum(1)[None, :]
    )


def separate_collisions(codes: np.ndarray, codebook_size: int) -> np.ndarray:
    """Append a level that numbers the items of each semantic ID 0, 1, ... in row order
    (TIGER's extra code), so that no two items share a semantic ID.

    Args:
        codes: int64 (num_items, num_levels).
        codebook_size: codes per level; the new level's codes must fit in it.

    Returns:
        int64 (num_items, num_levels + 1).

    Raises:
        XgrError: more items share one semantic ID than ``codebook_size``.
    """
    codes = np.asarray(codes, dtype=np.int64)
    _, inverse, counts = np.unique(codes, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    if counts.max() > codebook_size:
        raise XgrError(
            f"{counts.max()} items share one semantic ID, more than the codebook size "
            f"{codebook_size} the collision level can number: use a larger codebook or "
            "more levels"
        )
    order = np.argsort(inverse, kind="stable")
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    extra = np.empty(len(codes), dtype=np.int64)
    extra[order] = np.arange(len(codes)) - np.repeat(starts, counts)
    return np.concatenate([codes, extra[:, None]], axis=1)


def codebook_report(codes: np.ndarray, codebook_size: int) -> dict:
    """How the codes are used: per level the codes used and their perplexity (exp of the
    entropy of the level's code frequencies: ``codebook_size`` when used evenly), the
    distinct prefixes of each depth, and the collisions of the full IDs.

    Args:
        codes: int64 (num_items, num_levels).
        codebook_size: codes per level.

    Returns:
        ``{"items", "levels", "codebook_size", "per_level": [{"level", "codes_used",
        "perplexity", "distinct_prefixes"}, ...], "semantic_ids", "collided_semantic_ids",
        "items_in_collisions", "largest_collision"}``.
    """
    codes = np.asarray(codes, dtype=np.int64)
    per_level = []
    for level in range(codes.shape[1]):
        counts = np.bincount(codes[:, level], minlength=codebook_size)
        freq = counts[counts > 0] / len(codes)
        prefixes = len(np.unique(codes[:, : level + 1], axis=0))
        per_level.append(
            {
                "level": level,
                "codes_used": int((counts > 0).sum()),
                "perplexity": round(float(np.exp(-(freq * np.log(freq)).sum())), 2),
                "distinct_prefixes": prefixes,
            }
        )
    _, counts = np.unique(codes, axis=0, return_counts=True)
    return {
        "items": len(codes),
        "levels": codes.shape[1],
        "codebook_size": codebook_size,
        "per_level": per_level,
        "semantic_ids": len(counts),
        "collided_semantic_ids": int((counts > 1).sum()),
        "items_in_collisions": int(counts[counts > 1].sum()),
        "largest_collision": int(counts.max()),
    }


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


def load_embeddings(
    path: str | Path,
    item_ids: str | Path | None = None,
    id_column: str = "item_id",
    embedding_column: str = "embedding",
) -> tuple[list[str], np.ndarray]:
    """Item embeddings from a file.

    Args:
        path: a ``.npy`` float array (num_items, dim), with ``item_ids`` naming its rows, or
            a Parquet table with an ``id_column`` and either an ``embedding_column`` of
            float lists or, without one, one numeric column per dimension (needs pyarrow).
        item_ids: for ``.npy``: a text file of one item id per line, or a JSON list.
        id_column, embedding_column: the Parquet columns.

    Returns:
        the item ids (str) and a float64 array (num_items, dim).

    Raises:
        XgrError: an unknown suffix, an unreadable file, a missing column, ragged or
            non-finite vectors, ids that do not match the rows or repeat.
    """
    path = Path(path)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            if item_ids is None:
                raise XgrError(f"{path}: a .npy file needs --item-ids naming its rows")
            vectors = np.load(path, allow_pickle=False)
            ids = _read_item_ids(Path(item_ids))
        elif suffix == ".parquet":
            if item_ids is not None:
                raise XgrError(f"{path}: a Parquet table names its items in '{id_column}'")
            ids, vectors = _read_parquet(path, id_column, embedding_column)
        else:
            raise XgrError(f"{path}: embeddings must be a .npy or .parquet file")
    except (OSError, ValueError) as exc:
        raise XgrError(f"cannot read embeddings from {path}: {exc}") from exc
    vectors = np.asarray(vectors)
    if vectors.ndim != 2 or vectors.shape[0] == 0 or not np.issubdtype(vectors.dtype, np.number):
        raise XgrError(
            f"{path}: embeddings must be a numeric (num_items, dim) array, got "
            f"{vectors.dtype} {vectors.shape}"
        )
    if len(ids) != len(vectors):
        raise XgrError(f"{len(ids)} item ids for {len(vectors)} embedding rows in {path}")
    if len(set(ids)) != len(ids):
        seen: set[str] = set()
        dup = next(i for i in ids if i in seen or seen.add(i))
        raise XgrError(f"item id {dup!r} is given twice")
    vectors = vectors.astype(np.float64)
    if not np.isfinite(vectors).all():
        row = int(np.argwhere(~np.isfinite(vectors))[0][0])
        raise XgrError(f"{path}: the embedding of item {ids[row]!r} holds NaN or infinity")
    return ids, vectors


def _read_item_ids(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix.lower() == ".json":
        ids = json.loads(text)
        if not isinstance(ids, list) or not all(isinstance(i, str | int) for i in ids):
            raise XgrError(f"{path} must be a JSON list of item ids")
        return [str(i) for i in ids]
    return [line.strip() for line in text.splitlines() if line.strip()]


def _read_parquet(path: Path, id_column: str, embedding_column: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise XgrError(
            "reading Parquet needs the pyarrow package (pip install 'xgr[train]')"
        ) from None
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises its own exception types
        raise XgrError(f"cannot read Parquet {path}: {exc}") from exc
    if id_column not in table.column_names:
        raise XgrError(f"{path} has no column {id_column!r} (has {table.column_names})")
    ids = [str(i) for i in table.column(id_column).to_pylist()]
    if embedding_column in table.column_names:
        rows = table.column(embedding_column).to_pylist()
        if any(r is None for r in rows) or len({len(r) for r in rows}) > 1:
            raise XgrError(f"{path}: column {embedding_column!r} must hold lists of one length")
        return ids, np.asarray(rows, dtype=np.float64)
    others = [c for c in table.column_names if c != id_column]
    if not others:
        raise XgrError(f"{path} has no embedding columns besides {id_column!r}")
    try:
        columns = [np.asarray(table.column(c).to_pylist(), dtype=np.float64) for c in others]
    except (TypeError, ValueError):
        raise XgrError(
            f"{path}: without a column {embedding_column!r}, every other column must be "
            "numeric (one per dimension)"
        ) from None
    return ids, np.stack(columns, axis=1)


def build_catalog(
    item_ids: Sequence[str],
    embeddings: np.ndarray,
    num_levels: int = 3,
    codebook_size: int = 256,
    seed: int = 0,
    n_init: int = 4,
    backend: str = "sklearn",
    balanced: bool = False,
    collision_level: bool = False,
) -> tuple[ItemCatalog, dict]:
    """A catalog of semantic IDs from item embeddings, and its report.

    Args:
        item_ids: one id per embedding row.
        embeddings: float (num_items, dim).
        num_levels: levels of residual k-means.
        codebook_size: codes per level.
        seed, n_init, backend, balanced: as ``residual_kmeans``.
        collision_level: append ``separate_collisions``'s level (``num_levels + 1`` levels
            in all).

    Returns:
        the catalog and ``{"quantized": codebook_report of the k-means levels, "catalog":
        codebook_report of the catalog's codes, "settings": {...}}``.

    Raises:
        XgrError: as ``residual_kmeans``, ``separate_collisions`` and ``ItemCatalog``.
    """
    codes = residual_kmeans(embeddings, num_levels, codebook_size, seed, n_init, backend, balanced)
    report = {"quantized": codebook_report(codes, codebook_size)}
    if collision_level:
        codes = separate_collisions(codes, codebook_size)
    catalog = ItemCatalog.from_codes(list(item_ids), codes, codebook_size)
    report["catalog"] = codebook_report(codes, codebook_size)
    report["settings"] = {
        "levels": num_levels,
        "codebook_size": codebook_size,
        "collision_level": collision_level,
        "backend": backend,
        "balanced": balanced,
        "seed": seed,
        "n_init": n_init,
        "embedding_dim": int(np.asarray(embeddings).shape[1]),
    }
    return catalog, report
