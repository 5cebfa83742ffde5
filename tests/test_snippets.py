"""The drift guard: every snippet still prints exactly what the book recorded.

One test per snippet, named by its path. Each runs as a subprocess in the fixed
environment of snippets/_runner.py and its stdout must equal the .out beside it.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from engine.tools.edition import strip_html_comments
from tests.conftest import ROOT, load_runner

runner = load_runner()
SNIPPETS = runner.discover()
INCLUDE = re.compile(r'^\s*--8<-- "(?P<path>[^"]+)"\s*$', re.M)

# Experiment number -> chapter, from the book plan.
CHAPTER_OF = {
    n: c
    for c, ns in {
        1: range(1, 5),
        2: range(5, 9),
        3: range(9, 12),
        4: range(12, 16),
        5: range(16, 20),
        6: range(20, 23),
        7: range(23, 26),
        8: range(26, 29),
    }.items()
    for n in ns
}
# The one experiment allowed beyond the standard library (float non-associativity in torch).
NON_STDLIB = {23: {"torch"}}


def experiments() -> list[tuple[str, int, int]]:
    found = []
    for path in SNIPPETS:
        m = runner.EXPERIMENT.match(path)
        if m:
            found.append((path, int(m["chapter"]), int(m["number"])))
    return found


@pytest.mark.parametrize("path", SNIPPETS, ids=SNIPPETS)
def test_output_matches_record(path: str) -> None:
    record = runner.record_path(path)
    assert record.exists(), f"{path} has no recorded output.\n{runner.regen_hint(path)}"
    actual, results = runner.run(path)
    recorded = record.read_text()
    changed = runner.results_diff(path, runner.recorded_results(path), results)
    if actual != recorded or changed:
        pytest.fail(
            f"{path} no longer prints or returns what the book recorded:\n\n"
            f"{runner.diff(path, recorded, actual)}{changed}\n{runner.regen_hint(path)}",
            pytrace=False,
        )
    sidecar = runner.results_path(path)
    if sidecar.exists():  # byte for byte, as make regen writes it
        assert sidecar.read_text() == runner.results_text(results), runner.regen_hint(path)


def imported_modules(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text(), filename=path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_experiments_use_only_the_standard_library() -> None:
    offenders = {}
    for path, _, number in experiments():
        allowed = set(sys.stdlib_module_names) | {"__future__"} | NON_STDLIB.get(number, set())
        extra = imported_modules(path) - allowed
        if extra:
            offenders[path] = sorted(extra)
    assert not offenders, f"experiments import beyond the standard library: {offenders}"


def test_experiments_are_numbered_into_their_chapters() -> None:
    seen: dict[int, str] = {}
    for path, chapter, number in experiments():
        assert number in CHAPTER_OF, f"{path}: experiments are numbered 1 to 28"
        assert CHAPTER_OF[number] == chapter, (
            f"{path}: experiment {number} belongs in ch{CHAPTER_OF[number]:02d}"
        )
        assert number not in seen, f"{path} and {seen[number]} share number {number}"
        seen[number] = path


def page_includes() -> dict[str, list[str]]:
    """Every snippet include of every page (engine excerpts are checked elsewhere).
    HTML comments are blanked first: what a comment holds is not shown."""
    includes = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = strip_html_comments(page.read_text())
        paths = [p for p in INCLUDE.findall(text) if not p.startswith("engine/")]
        includes[page.relative_to(ROOT).as_posix()] = paths
    return includes


def test_every_include_resolves() -> None:
    missing = [
        f"{page}: {path}"
        for page, paths in page_includes().items()
        for path in paths
        if not (ROOT / path).is_file()
    ]
    assert not missing, "includes that point at no file:\n" + "\n".join(missing)


OUTPUT_BLOCK = re.compile(r"^\s*(\?\?\?\+?|!!!) output\b")
FENCE_OPEN = re.compile(r"^\s*(`{3,}|~{3,})")


def misplaced_outputs(markdown: str) -> list[str]:
    """Each X.out must follow its own X.py on the same page, before the next
    snippet's source, inside that experiment's output block: so two outputs
    cannot trade places, and an output cannot stand outside its box."""
    lines = strip_html_comments(markdown).splitlines()
    problems, current = [], None
    for i, line in enumerate(lines):
        m = INCLUDE.match(line)
        if not m or m["path"].startswith("engine/"):
            continue
        path = m["path"]
        if path.endswith(".py"):
            current = path
            continue
        if not path.endswith(".out"):
            continue
        source = path[: -len(".out")] + ".py"
        if source != current:
            problems.append(f"line {i + 1}: {path} does not follow {source} (it follows {current})")
            continue
        indent = len(line) - len(line.lstrip())
        j = i - 1
        while j >= 0 and (not lines[j].strip() or FENCE_OPEN.match(lines[j])):
            j -= 1
        while j >= 0 and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) >= indent):
            j -= 1
        if j < 0 or not OUTPUT_BLOCK.match(lines[j]):
            problems.append(f"line {i + 1}: {path} is not inside an '??? output' block")
    return problems


def test_every_output_sits_in_its_experiments_output_block() -> None:
    problems = [
        f"{page.relative_to(ROOT)}: {p}"
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for p in misplaced_outputs(page.read_text())
    ]
    assert not problems, "\n".join(problems)


def test_every_snippet_and_output_is_shown_by_a_page() -> None:
    shown = {path for paths in page_includes().values() for path in paths}
    expected = set(SNIPPETS) | {Path(p).with_suffix(".out").as_posix() for p in SNIPPETS}
    orphans = sorted(expected - shown)
    assert not orphans, "snippet files that no page includes:\n" + "\n".join(orphans)


def test_every_chapter_file_is_a_known_kind() -> None:
    """A stray file in snippets/chNN/ would escape the guard; name it as the convention says."""
    strays = []
    for path in sorted(ROOT.glob("snippets/ch*/*")):
        rel = path.relative_to(ROOT).as_posix()
        if path.name == "__pycache__":
            continue
        source = str(Path(rel).with_suffix(".py")) if path.suffix in (".out", ".json") else rel
        if source not in SNIPPETS:
            strays.append(rel)
    assert not strays, (
        "files in snippets/chNN/ that are neither eNN_slug nor demo_slug:\n" + "\n".join(strays)
    )
