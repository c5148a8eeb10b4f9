"""Imports point down: no part of the package imports one listed above it."""

from __future__ import annotations

import ast
from pathlib import Path

# Top to bottom, as docs/architecture.md lists them.
ORDER = ["cli", "demo", "training", "bench", "server", "client", "scheduler", "engine", "runner",
         "models", "layers", "beam", "catalog", "evaluation", "kv", "kernels", "core"]  # fmt: skip
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "xgr"


def imported_parts(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name.split(".")[1] for name in names if name.startswith("xgr.")}


def test_every_part_imports_only_parts_below_it():
    rank = {name: i for i, name in enumerate(ORDER)}
    parts = {p.name.removesuffix(".py") for p in PACKAGE.iterdir() if not p.name.startswith("_")}
    assert parts - {"py.typed"} == set(ORDER)  # a new part needs its place in the order
    upward = []
    for path in PACKAGE.rglob("*.py"):
        part = path.relative_to(PACKAGE).parts[0].removesuffix(".py")
        if part not in rank:
            continue
        upward += [
            f"{path.relative_to(PACKAGE)} imports xgr.{target}"
            for target in imported_parts(path)
            if target in rank and rank[target] < rank[part]
        ]
    assert not upward
