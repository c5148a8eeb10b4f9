import numpy as np
import pytest

from xgr.core import XgrError
from xgr.training.semantic_ids import item_embeddings, residual_kmeans, semantic_ids


def _sequences(seed=0, users=120, items=60):
    # Two taste groups: users mostly pick from one half of the items.
    rng = np.random.default_rng(seed)
    seqs = []
    for user in range(users):
        half = np.arange(items // 2) + (items // 2) * (user % 2)
        picks = rng.choice(half, size=12, replace=False)
        seqs.append([str(i) for i in picks])
    return seqs, [str(i) for i in range(items)]


def test_shape_range_and_determinism():
    seqs, items = _sequences()
    codes = semantic_ids(seqs, items, num_levels=3, codebook_size=8, embedding_dim=8)
    assert codes.shape == (60, 3) and codes.dtype == np.int64
    assert codes.min() >= 0 and codes.max() < 8
    again = semantic_ids(seqs, items, num_levels=3, codebook_size=8, embedding_dim=8)
    np.testing.assert_array_equal(codes, again)


def test_first_level_separates_taste_groups():
    seqs, items = _sequences()
    codes = semantic_ids(seqs, items, num_levels=2, codebook_size=2, embedding_dim=4)
    first, second = set(codes[:30, 0]), set(codes[30:, 0])
    assert len(first) == 1 and len(second) == 1 and first != second


def test_embeddings_are_unit_rows_and_zero_for_unseen():
    seqs, items = _sequences()
    vectors = item_embeddings(seqs, [*items, "never-seen"], embedding_dim=6)
    assert vectors.shape == (61, 6) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors[:60], axis=1), 1.0, rtol=1e-5)
    assert not vectors[60].any()


def test_residual_levels_reduce_error():
    rng = np.random.default_rng(1)
    data = rng.normal(size=(200, 5))
    codes = residual_kmeans(data, num_levels=1, codebook_size=4)
    assert codes.shape == (200, 1)
    assert len(np.unique(residual_kmeans(data, 3, 4), axis=0)) > len(np.unique(codes, axis=0))


def test_bad_sizes_raise():
    with pytest.raises(XgrError, match="codebook_size"):
        residual_kmeans(np.zeros((3, 2)), 1, 4)
    with pytest.raises(XgrError, match="embedding_dim"):
        item_embeddings([["a", "b"]], ["a", "b"], embedding_dim=5)
    with pytest.raises(XgrError, match="no interactions"):
        item_embeddings([["x"]], ["a"], embedding_dim=1)
