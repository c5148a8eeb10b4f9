"""The installed package imports from any working folder, even one holding a folder named
``xgr`` (a clone of the repository, say), which a flat layout's editable install loses to."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution

import pytest


def test_import_from_a_folder_holding_an_empty_xgr_folder(tmp_path):
    try:
        distribution("xgr")
    except PackageNotFoundError:
        pytest.skip("xgr is not installed here (run from the source tree)")
    (tmp_path / "xgr").mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run(
        [sys.executable, "-c", "import xgr; print(xgr.ItemCatalog.__name__, xgr.__version__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["ItemCatalog", distribution("xgr").version]
