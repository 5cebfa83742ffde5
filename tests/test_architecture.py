"""The architecture page cannot go stale: every part its diagram and its text
name is in its table, every row of the table names a class its module defines,
and the numbered arrows are LLMEngine.step's calls, in order, each a method of
the class it points at."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

PAGE = ROOT / "docs" / "architecture.md"
NODE = re.compile(r"\b(\w+)\[(\w+)\]")
EDGE = re.compile(r"\b(\w+)\s*-->\s*\|([\d, ]+)\|\s*(\w+)\b")  # arrows numbered by call
CALL = re.compile(r"^(\d)\. \*\*(\w+)\.\*\*", re.M)  # "1. **schedule.** ..."
ROW = re.compile(r"^\| `(\w+)` \| `(engine/[\w/]+\.py)` \|", re.M)


def diagram() -> str:
    """The diagram's text, without its `---` settings block."""
    text = re.search(r"```mermaid\n(.*?)```", PAGE.read_text(), re.S)[1]
    return re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)


def table() -> dict[str, str]:
    return dict(ROW.findall(PAGE.read_text()))


def classes(module: str) -> dict[str, ast.ClassDef]:
    tree = ast.parse((ROOT / module).read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def test_every_row_names_a_class_its_module_defines() -> None:
    rows = table()
    assert len(rows) > 10
    missing = [
        f"{name} in {module}" for name, module in rows.items() if name not in classes(module)
    ]
    assert not missing, missing


def test_every_part_the_page_names_is_in_the_table() -> None:
    nodes = dict(NODE.findall(diagram()))
    assert len(nodes) >= 8
    text = PAGE.read_text().split("## Where each part lives")[0]
    named = set(re.findall(r"`([A-Z]\w+)`", text))  # class names in the prose
    missing = sorted((set(nodes.values()) | named) - set(table()))
    assert not missing, missing


def step_calls() -> list[str]:
    """The methods LLMEngine.step calls, in the order it calls them."""
    tree = ast.parse((ROOT / "engine" / "core" / "llm_engine.py").read_text())
    step = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "step")
    calls = sorted(
        (n for n in ast.walk(step) if isinstance(n, ast.Call)),
        key=lambda n: (n.lineno, n.col_offset),
    )
    return [n.func.attr for n in calls if isinstance(n.func, ast.Attribute)]


def test_the_numbered_arrows_are_the_steps_calls() -> None:
    nodes, rows = dict(NODE.findall(diagram())), table()
    calls = dict(CALL.findall(PAGE.read_text()))  # number -> method
    assert list(calls) == ["1", "2", "3", "4"]
    assert [c for c in step_calls() if c in calls.values()] == list(calls.values())
    numbered = {}
    for source, numbers, target in EDGE.findall(diagram()):
        assert nodes[source] == "LLMEngine"
        for number in numbers.split(","):
            numbered[number.strip()] = nodes[target]
    assert sorted(numbered) == list(calls)
    for number, target in numbered.items():
        methods = methods_of(rows[target], target)
        assert calls[number] in methods, f"{target} has no method {calls[number]}"


def methods_of(module: str, name: str) -> set[str]:
    """The methods class ``name`` of ``module`` defines or inherits from a base
    class of the engine (the scheduler's fold-in half is a mixin, sched/fold.py)."""
    tree = ast.parse((ROOT / module).read_text())
    cls = classes(module)[name]
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    imported = {
        alias.name: node.module
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engine.")
        for alias in node.names
    }
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in imported:
            path = imported[base.id].replace(".", "/") + ".py"
            methods |= methods_of(path, base.id)
    return methods


def test_the_page_is_in_the_book_right_after_the_preface() -> None:
    nav = [line.strip() for line in (ROOT / "mkdocs.yml").read_text().splitlines()]
    preface = nav.index("- index.md")
    assert nav[preface + 1] == "- architecture.md"


def test_the_diagram_reads_on_a_phone() -> None:
    """Top to bottom, few nodes, short labels: the page is read on narrow screens too."""
    assert diagram().splitlines()[0].strip() == "flowchart TB"
    labels = [label for _, label in NODE.findall(diagram())]
    assert len(labels) <= 10 and max(map(len, labels)) <= 16, labels


def test_the_folder_table_lists_every_folder_and_root_module() -> None:
    """The page's table of folders is the engine's layout: every package under
    engine/ and every module at its root but __init__.py, and nothing more."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The folders", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `(engine/[\w/.]+)` \|", section, re.M))
    engine = ROOT / "engine"
    actual = {f"engine/{p.name}" for p in engine.glob("*.py") if p.name != "__init__.py"}
    actual |= {f"engine/{p.parent.name}/" for p in engine.glob("*/__init__.py")}
    assert listed == actual, (sorted(listed - actual), sorted(actual - listed))
