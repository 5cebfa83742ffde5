"""Appendix B, the map of the repository, generated from the tree when the book
is built: every file of engine/ with its length, its role (the first line of
its docstring), the pages that quote it (from the edition manifest) and the
tests that import it, grouped by folder; and a diagram of which folders import
which. Nothing is typed by hand, so the page cannot go stale."""

from __future__ import annotations

import ast
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine.tools.import_graph import module_graph, module_name, reduced, runtime_imports

ROOT_FOLDER = "engine/"  # the package's own modules, outside any folder


@dataclass
class EngineFile:
    path: str  # engine/kv/hashing.py
    lines: int
    role: str  # the docstring's first line ("" when it has none)
    pages: list[str] = field(default_factory=list)  # the pages that quote it
    tests: list[str] = field(default_factory=list)  # tests/... files that import it


def role(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text(), filename=str(path))) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def folder_of(path: str) -> str:
    parts = path.split("/")
    return "/".join(parts[:2]) + "/" if len(parts) > 2 else ROOT_FOLDER


def engine_files(root: Path) -> list[EngineFile]:
    files = [
        EngineFile(str(p.relative_to(root)), len(p.read_text().splitlines()), role(p))
        for p in sorted((root / "engine").rglob("*.py"))
    ]
    by_path = {f.path: f for f in files}
    for entry in json.loads((root / "docs" / "edition.json").read_text())["excerpts"]:
        quoted = by_path.get(entry["file"])
        if quoted is not None and entry["page"] not in quoted.pages:
            quoted.pages.append(entry["page"])
    modules = {module_name(root / f.path, root): f for f in files}
    for test in sorted((root / "tests").rglob("test_*.py")):
        for module in runtime_imports(test, set(modules)):
            modules[module].tests.append(str(test.relative_to(root)))
    return files


def folder_edges(root: Path) -> dict[str, set[str]]:
    """Folder -> the folders its modules import, less the package's own root
    modules (every folder reads them) and engine/tools/ (which reads every folder)."""
    graph = module_graph(root / "engine", root)
    path_of = {
        module_name(p, root): str(p.relative_to(root)) for p in (root / "engine").rglob("*.py")
    }
    edges: dict[str, set[str]] = defaultdict(set)
    for module, imported in graph.items():
        a = folder_of(path_of[module])
        for target in imported:
            b = folder_of(path_of[target])
            if a != b and ROOT_FOLDER not in (a, b) and "engine/tools/" not in (a, b):
                edges[a].add(b)
    return reduced(edges)


def _node(folder: str) -> str:
    return folder.removeprefix("engine/").rstrip("/")


def diagram(root: Path) -> list[str]:
    edges = folder_edges(root)
    # Drawn at its natural size: on a phone it scrolls sideways rather than shrink its text.
    settings = [
        "---",
        "config:",
        "  flowchart:",
        "    useMaxWidth: false",
        "    nodeSpacing: 16",
        "---",
    ]
    lines = ["```mermaid", *settings, "flowchart TB"]
    for a in sorted(edges):
        lines += [f"    {_node(a)} --> {_node(b)}" for b in sorted(edges[a])]
    return [*lines, "```"]


def page_label(page: str) -> str:
    """How a table cell names a page: "Ch. 2" for Chapter 2's, else the page's kind."""
    if page.startswith("ch") and page[2:4].isdigit():
        return f"Ch. {int(page[2:4])}"
    return {"index.md": "Preface", "architecture.md": "Layout"}.get(page, page.removesuffix(".md"))


def _row(f: EngineFile, folder: str) -> str:
    name = f.path.removeprefix(folder)
    tests = len(f.tests)
    listed = " ".join(Path(t).stem for t in f.tests)
    counts = f'{f.lines} lines, <span title="{listed}">{tests} test file{"s" * (tests != 1)}</span>'
    pages = ", ".join(f"[{page_label(p)}]({p})" for p in sorted(f.pages)) or "none"
    return f"| `{name}`<br>{counts} | {first_sentence(f.role) or '(no docstring)'} | {pages} |"


def first_sentence(text: str) -> str:
    end = text.find(". ")
    return text if end < 0 else text[: end + 1]


def folder_table(folder: str, files: list[EngineFile], root: Path) -> list[str]:
    init = root / folder / "__init__.py"
    heading = f"## `{folder}`"
    about = (
        role(init)
        if folder != ROOT_FOLDER and init.exists()
        else (
            "The modules every folder shares: the engine's configuration, requests, "
            "outputs and the offline entry point."
        )
    )
    return [
        heading,
        "",
        about,
        "",
        '<div class="repo-map" markdown>',
        "",
        "| File | What it is | Quoted in |",
        "|---|---|---|",
        *(_row(f, folder) for f in files),
        "",
        "</div>",
        "",
        "/// table-caption",
        f"The files of `{folder}`.",
        "///",
        "",
    ]


def markdown(root: Path) -> str:
    """The map's body: the folders' diagram, then a table per folder."""
    files = engine_files(root)
    by_folder: dict[str, list[EngineFile]] = defaultdict(list)
    for f in files:
        by_folder[folder_of(f.path)].append(f)
    out = [*diagram(root), "", "/// figure-caption", FIGURE_CAPTION, "///", ""]
    for folder in sorted(by_folder, key=lambda d: (d != ROOT_FOLDER, d)):
        out += folder_table(folder, by_folder[folder], root)
    return "\n".join(out)


FIGURE_CAPTION = (
    "Which folders of engine/ import which, drawn from the source: an arrow means the folder "
    "imports the other, directly or through the folders between them."
)
