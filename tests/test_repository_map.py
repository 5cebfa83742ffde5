"""Appendix B cannot go stale or break: the built page lists every file of engine/
with its true length, and nothing else; every file has a docstring to give its
role, cut at a whole sentence and shown as written; every page it links has a
name a reader can read; a folder's description names no file that is not there,
or only some of them; and the diagram puts each folder above the folders it
imports, knots of folders that import each other in one layer."""

from __future__ import annotations

import itertools
import json
import random
import re
from html import unescape

import markdown
import pytest

from engine.tools.import_graph import _reaches, reduced
from engine.tools.repo_map import (
    as_markdown,
    counted,
    diagram,
    first_sentence,
    folder_edges,
    folder_of,
    knots,
    layers,
    page_label,
    role,
)
from tests.conftest import ROOT

ENGINE_FILES = sorted((ROOT / "engine").rglob("*.py"))
ROW = re.compile(r"<td><code>([^<]+)</code><br ?/?>\s*(\d+) lines?")
SECTION = re.compile(r'<h2 id="[^"]*"><code>(engine/[\w/]*)</code>')


def test_every_engine_file_has_a_docstring() -> None:
    missing = [str(p.relative_to(ROOT)) for p in ENGINE_FILES if not role(p)]
    assert not missing, f"no docstring, so no role in Appendix B: {missing}"


def test_the_built_map_lists_every_file_with_its_length(site) -> None:
    html = (site.path / "appendix-b-repository-map" / "index.html").read_text()
    listed: dict[str, int] = {}
    starts = [(m.start(), m[1]) for m in SECTION.finditer(html)]
    for (start, folder), (end, _) in zip(starts, [*starts[1:], (len(html), "")]):
        for name, lines in ROW.findall(html[start:end]):
            path = folder + unescape(name)
            listed[path] = int(lines)
    tree = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in ENGINE_FILES}
    assert listed == tree
    folders = {folder_of(path) for path in tree}
    assert [f for _, f in starts] == sorted(folders, key=lambda d: (d != "engine/", d))


def test_the_reduced_graph_reaches_what_the_graph_reaches() -> None:
    rng = random.Random(0)
    for _ in range(200):
        nodes = list("abcdef")
        edges = {n: {m for m in nodes if m != n and rng.random() < 0.3} for n in nodes}
        kept = reduced(edges)
        assert all(kept[a] <= edges[a] for a in nodes)
        for a, b in itertools.permutations(nodes, 2):
            assert _reaches(kept, a, b) == _reaches(edges, a, b), (edges, kept, a, b)
        for a in nodes:  # and no arrow left that another path already gives
            for b in kept[a]:
                without = {**kept, a: kept[a] - {b}}
                assert not _reaches(without, a, b)


def shown(cell_markdown: str) -> str:
    """The text a reader sees in a table cell: rendered as the site renders it."""
    html = markdown.markdown(f"| a |\n|---|\n| {cell_markdown} |", extensions=["tables"])
    cell = html.split("<td>", 1)[1].split("</td>", 1)[0]
    return unescape(re.sub(r"<[^>]+>", "", cell)).strip()


def test_every_summary_is_a_whole_sentence_shown_as_written() -> None:
    broken = []
    for path in ENGINE_FILES:
        summary = first_sentence(role(path))
        balanced = summary.count("(") == summary.count(")") and summary.count("`") % 2 == 0
        if not balanced or summary[-1] not in ".?!":  # a colon reads as cut off
            broken.append(f"{path.relative_to(ROOT)}: cut at {summary!r}")
        if shown(as_markdown(summary)) != summary.replace("``", "`").replace("`", ""):
            broken.append(
                f"{path.relative_to(ROOT)}: {summary!r} shows as {shown(as_markdown(summary))!r}"
            )
    assert not broken, "\n".join(broken)


def test_a_summary_keeps_abbreviations_and_markup() -> None:
    text = "Drafts (Leviathan et al. 2023, e.g. this). Then more."
    assert first_sentence(text) == "Drafts (Leviathan et al. 2023, e.g. this)."
    # A paragraph that introduces a listing ends as a sentence, not on its colon.
    assert first_sentence("Errors in OpenAI's shape, as its clients read them:") == (
        "Errors in OpenAI's shape, as its clients read them."
    )
    assert shown(as_markdown("the book's text (docs/*.md and engine/**/*.py) a|b")) == (
        "the book's text (docs/*.md and engine/**/*.py) a|b"
    )
    assert shown(as_markdown("metrics under ``deepinfer:*`` and __init__")) == (
        "metrics under deepinfer:* and __init__"
    )


def test_counts_agree_with_their_nouns() -> None:
    assert counted(1, "line") == "1 line" and counted(2, "line") == "2 lines"
    assert counted(0, "test file") == "no test files"


def test_every_quoting_page_has_a_readable_name() -> None:
    pages = {
        e["page"] for e in json.loads((ROOT / "docs" / "edition.json").read_text())["excerpts"]
    }
    for page in pages:
        label = page_label(page)
        assert not label.endswith(".md") and "-" not in label, (page, label)
    assert page_label("appendix-a-compression.md") == "App. A"
    with pytest.raises(ValueError, match="no short name"):
        page_label("new-page.md")


def test_a_folder_description_names_its_files_truly() -> None:
    """A folder's description that names files of its folder names every one of
    them (a list that leaves some out was written before they were), and no file
    that is not there; a path (engine/config/model.py) is read from the root."""
    stale = []
    for init in sorted((ROOT / "engine").glob("*/__init__.py")):
        folder = init.parent
        named = re.findall(r"(?<![\w/.])((?:[\w]+/)*[a-z_0-9]+\.py)\b", role(init))
        where = {n: ROOT / n if "/" in n else folder / n for n in named}
        missing = [n for n, path in where.items() if not path.exists()]
        own = {path.name for path in where.values() if path.parent == folder}
        files = {p.name for p in folder.glob("*.py")} - {"__init__.py"}
        left_out = files - own if own & files else set()
        if missing or left_out:
            stale.append(f"{folder.relative_to(ROOT)}: names {sorted(missing)} that are not there,"
                         f" leaves out {sorted(left_out)}")  # fmt: skip
    assert not stale, "stale folder descriptions:\n" + "\n".join(stale)


def test_layers_put_each_folder_above_what_it_imports() -> None:
    rng = random.Random(1)
    for _ in range(200):
        nodes = list("abcdefg")
        edges = {n: {m for m in nodes if m != n and rng.random() < 0.25} for n in nodes}
        level = {n: i for i, tier in enumerate(layers(edges)) for n in tier}
        assert sorted(level) == nodes
        knot_of = {n: frozenset(k) for k in knots(edges) for n in k}
        for a, b in itertools.permutations(nodes, 2):
            both_ways = _reaches(edges, a, b) and _reaches(edges, b, a)
            assert (knot_of.get(a) is not None and b in knot_of[a]) == both_ways
            if b in edges[a] and not both_ways:
                assert level[a] > level[b], (edges, a, b)
            if both_ways:
                assert level[a] == level[b]


def test_the_diagram_draws_every_folder_once() -> None:
    lines = diagram(ROOT)
    drawn = "\n".join(lines[lines.index("flowchart TB") :])  # the nodes, not the settings
    edges = folder_edges(ROOT)
    folders = set(edges) | {b for bs in edges.values() for b in bs}
    for folder in folders:
        name = folder.removeprefix("engine/").rstrip("/")
        assert len(re.findall(rf"(?<![\w/]){name}(?![\w/])", drawn)) == 1, name
