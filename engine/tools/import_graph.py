"""Which engine modules import which, read from the source with `ast` (nothing
is imported): what the layout test checks for cycles, and what Appendix B
draws between folders."""

from __future__ import annotations

import ast
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """engine/kv/hashing.py -> engine.kv.hashing; a package's __init__ is the package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` a file imports when it runs: at any depth, inside
    functions too, but not under ``if TYPE_CHECKING:``. ``from a import b``
    imports the module ``a.b`` when there is one, else ``a``."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for stmt in child.orelse:
                    visit_one(stmt)
            else:
                visit_one(child)

    def visit_one(node: ast.AST) -> None:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    found.add(sub)
                elif node.module in known:
                    found.add(node.module)
        visit(node)

    visit(ast.parse(path.read_text(), filename=str(path)))
    return found


def module_graph(package: Path, root: Path) -> dict[str, set[str]]:
    """Every module under ``package`` and the modules of the package it imports."""
    files = sorted(package.rglob("*.py"))
    known = {module_name(p, root) for p in files}
    return {module_name(p, root): runtime_imports(p, known) for p in files}


def reduced(edges: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same reachability with fewer arrows: an arrow a -> b goes when b can be
    reached from a another way. Arrows are tried in sorted order, one at a time."""
    kept = {a: set(bs) for a, bs in edges.items()}
    for a in sorted(kept):
        for b in sorted(kept[a]):
            kept[a].discard(b)
            if not _reaches(kept, a, b):
                kept[a].add(b)
    return kept


def _reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    seen, frontier = {start}, [start]
    while frontier:
        for nxt in edges.get(frontier.pop(), ()):
            if nxt == goal:
                return True
            if nxt not in seen:
                seen.add(nxt)
                frontier.append(nxt)
    return False
