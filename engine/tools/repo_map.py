"""Appendix B, the map of the repository, generated from the tree when the book
is built: every file of engine/ with its length, its role (the first sentence
of its docstring), the pages that quote it (from the edition manifest) and the
test files that import it, grouped by folder under its package's own docstring;
and a diagram of which folders import which, in layers. Nothing is typed by
hand, so the page cannot go stale."""

from __future__ import annotations

import ast
import json
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from engine.tools.import_graph import _reaches, module_graph, module_name, reduced, runtime_imports

ROOT_FOLDER = "engine/"  # the package's own modules, outside any folder
ROOT_ABOUT = "The package's own modules, outside any folder. The figure leaves them out."


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


def knots(edges: dict[str, set[str]]) -> list[set[str]]:
    """The groups of two or more folders that import each other in a cycle (the
    graph's strongly connected components), which no layering can order."""
    nodes = sorted(set(edges) | {b for bs in edges.values() for b in bs})
    found: list[set[str]] = []
    placed: set[str] = set()
    for a in nodes:
        if a in placed:
            continue
        group = {a} | {
            b for b in nodes if b != a and _reaches(edges, a, b) and _reaches(edges, b, a)
        }
        placed |= group
        if len(group) > 1:
            found.append(group)
    return found


def layers(edges: dict[str, set[str]]) -> list[list[str]]:
    """The folders in layers, bottom first: a folder sits one layer above the
    highest folder it imports; the folders of a knot share one layer."""
    group_of = {f: frozenset(k) for k in knots(edges) for f in k}
    nodes = sorted(set(edges) | {b for bs in edges.values() for b in bs})
    height: dict[frozenset[str], int] = {}

    def climb(group: frozenset[str]) -> int:
        if group not in height:
            height[group] = 0  # a knot's own arrows do not raise it
            below = {group_of.get(b, frozenset({b})) for a in group for b in edges.get(a, ())}
            height[group] = 1 + max((climb(g) for g in below - {group}), default=-1)
        return height[group]

    out: dict[int, list[str]] = defaultdict(list)
    for n in nodes:
        out[climb(group_of.get(n, frozenset({n})))].append(n)
    return [out[h] for h in sorted(out)]


def diagram(root: Path) -> list[str]:
    """The folders' layering, top layer first, one row of boxes a layer; a knot
    of folders that import each other is drawn as one box that names them."""
    edges = folder_edges(root)
    # Drawn at its natural size: one narrow column of layers that fits a phone.
    settings = [
        "---",
        "config:",
        "  flowchart:",
        "    useMaxWidth: false",
        "    rankSpacing: 28",
        "---",
    ]
    lines = ["```mermaid", *settings, "flowchart TB"]
    tiers = layers(edges)
    group_of = {f: sorted(k) for k in knots(edges) for f in k}
    drawn: set[str] = set()
    for depth, tier in enumerate(reversed(tiers)):
        names = []
        for folder in tier:
            knot = group_of.get(folder, [folder])
            if knot[0] in drawn:
                continue
            drawn.add(knot[0])
            names.append(" ⇄ ".join(_node(f) for f in knot))
        lines.append(f'    L{depth}["{"  ·  ".join(names)}"]')
    lines += [f"    L{d} --> L{d + 1}" for d in range(len(tiers) - 1)]
    return [*lines, "```"]


def page_label(page: str) -> str:
    """How a table cell names a page: "Ch. 2" for Chapter 2's, "App. A" for an
    appendix's, else the page's kind; a page it cannot name is an error."""
    if m := re.fullmatch(r"ch(\d\d)-[\w-]+\.md", page):
        return f"Ch. {int(m[1])}"
    if m := re.fullmatch(r"appendix-([a-z])-[\w-]+\.md", page):
        return f"App. {m[1].upper()}"
    named = {"index.md": "Preface", "architecture.md": "Layout"}
    if page not in named:
        raise ValueError(f"Appendix B has no short name for the page {page}")
    return named[page]


def counted(n: int, noun: str) -> str:
    """ "1 line", "2 lines", "no test file"."""
    return f"{n or 'no'} {noun}{'s' * (n != 1)}"


def _row(f: EngineFile, folder: str) -> str:
    name = f.path.removeprefix(folder)
    listed = " ".join(Path(t).stem for t in f.tests)
    tests = f'<span title="{listed}">imported by {counted(len(f.tests), "test file")}</span>'
    pages = ", ".join(f"[{page_label(p)}]({p})" for p in sorted(f.pages)) or "none"
    about = as_markdown(first_sentence(f.role)) or "(no docstring)"
    return f"| `{name}`<br>{counted(f.lines, 'line')}, {tests} | {about} | {pages} |"


ABBREVIATIONS = ("al.", "e.g.", "i.e.", "etc.", "vs.", "cf.", "Fig.", "Ch.")


def first_sentence(text: str) -> str:
    """Up to the first full stop that ends a sentence: outside brackets and code,
    and not one that ends an abbreviation ("et al.", "e.g.")."""
    depth, code = 0, False
    for i, ch in enumerate(text):
        if ch == "`":
            code = not code
        elif not code and ch in "([":
            depth += 1
        elif not code and ch in ")]":
            depth -= 1
        elif ch == "." and not code and depth <= 0 and text[i + 1 : i + 2] in (" ", ""):
            word = text[: i + 1].rsplit(" ", 1)[-1]
            if not word.endswith(ABBREVIATIONS):
                return text[: i + 1]
    # A first paragraph that introduces a listing ("... the SDK's events:") ends there.
    return text[:-1] + "." if text.endswith(":") else text


def as_markdown(text: str) -> str:
    """A docstring's text as a table cell shows it: code spans kept (RST's double
    backticks become Markdown's), and outside them the characters Markdown or a
    table would read as markup escaped, so that docs/*.md keeps its asterisks."""
    parts = re.split(r"(``[^`]+``|`[^`]+`)", text)
    out = []
    for i, part in enumerate(parts):
        if i % 2:
            out.append("`" + part.strip("`").replace("|", "\\|") + "`")
        else:
            out.append(re.sub(r"([\\*_|<>\[\]#])", r"\\\1", part))
    return "".join(out)


def folder_table(folder: str, files: list[EngineFile], root: Path) -> list[str]:
    init = root / folder / "__init__.py"
    heading = f"## `{folder}`"
    about = as_markdown(role(init)) if folder != ROOT_FOLDER else ROOT_ABOUT
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
    caption = FIGURE_CAPTION + (KNOT_CAPTION if knots(folder_edges(root)) else "")
    out = [*diagram(root), "", "/// figure-caption", caption, "///", ""]
    for folder in sorted(by_folder, key=lambda d: (d != ROOT_FOLDER, d)):
        out += folder_table(folder, by_folder[folder], root)
    return "\n".join(out)


FIGURE_CAPTION = (
    "The folders of engine/ in layers, drawn from the source's imports: a folder imports only "
    "folders in the layers below its own."
)
KNOT_CAPTION = " Folders joined by ⇄ import each other in a cycle, which no layering can order."
