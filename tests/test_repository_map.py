"""Appendix B cannot go stale: the built page lists every file of engine/ with its
true length, and nothing else; every file has a docstring to give its role;
and the folder diagram keeps exactly the reachability of the folders' imports."""

from __future__ import annotations

import itertools
import random
import re
from html import unescape

from engine.tools.import_graph import _reaches, reduced
from engine.tools.repo_map import folder_of, role
from tests.conftest import ROOT

ENGINE_FILES = sorted((ROOT / "engine").rglob("*.py"))
ROW = re.compile(r"<td><code>([^<]+)</code><br ?/?>\s*(\d+) lines")
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
