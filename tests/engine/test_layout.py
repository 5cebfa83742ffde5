"""The engine's import graph: tools sit outside the core, and kernels below it.

The core (everything in engine/ but engine/tools/) must run without the
command line, the benchmarks or the book's edition checker; the Triton kernels
must not reach up into the engine that uses them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

ENGINE = ROOT / "engine"


def imports(path: Path) -> set[str]:
    """Every absolute module name a file imports, at any depth (lazy imports count)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def modules(under: Path) -> list[Path]:
    return sorted(under.rglob("*.py"))


def test_no_core_module_imports_the_tools() -> None:
    offenders = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in modules(ENGINE)
        if ENGINE / "tools" not in p.parents
        for name in sorted(imports(p))
        if name == "engine.tools" or name.startswith("engine.tools.")
    ]
    assert not offenders, "\n".join(offenders)


def test_kernels_do_not_import_the_engine_above_them() -> None:
    offenders = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in modules(ENGINE / "kernels")
        for name in sorted(imports(p))
        if name.startswith("engine.") and not name.startswith("engine.kernels")
    ]
    assert not offenders, "\n".join(offenders)


def test_one_ceiling_division() -> None:
    """engine.utils.cdiv is the engine's only spelling of ceiling division."""
    offenders = [
        str(p.relative_to(ROOT))
        for p in modules(ENGINE)
        if p != ENGINE / "utils.py" and "-(-" in p.read_text()
    ]
    assert not offenders, offenders
