"""kernels/ sits at the bottom of the package: it imports nothing from above it, no private
name of another module, and its modules import each other without a loop."""

from __future__ import annotations

import ast
from pathlib import Path

import xgr.kernels

KERNELS = Path(xgr.kernels.__file__).parent
ALLOWED = ("xgr.kernels", "xgr.core")  # the package's bottom: its own modules, core types


def imports_of(path: Path) -> list[tuple[str, list[str]]]:
    """(module, names) of every ``from xgr... import`` in a file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("xgr"):
            found.append((node.module, [alias.name for alias in node.names]))
        elif isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.startswith("xgr")]
    return found


def test_kernels_import_only_downward_and_no_private_names():
    for path in sorted(KERNELS.glob("*.py")):
        for module, names in imports_of(path):
            assert module.startswith(ALLOWED), f"{path.name} imports {module}"
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{path.name} imports private {private} from {module}"


def test_kernel_modules_import_each_other_without_a_loop():
    graph = {
        path.stem: {
            module.removeprefix("xgr.kernels.")
            for module, _ in imports_of(path)
            if module.startswith("xgr.kernels.")
        }
        for path in KERNELS.glob("*.py")
    }
    done, active = set(), []

    def visit(name: str) -> None:
        assert name not in active, f"import loop: {' -> '.join([*active, name])}"
        if name in done:
            return
        active.append(name)
        for other in sorted(graph.get(name, ())):
            visit(other)
        active.pop()
        done.add(name)

    for name in sorted(graph):
        visit(name)
    assert len(done) == len(graph) > 10
