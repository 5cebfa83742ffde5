"""The drift guard: every snippet still prints exactly what the book recorded.

One test per snippet, named by its path. Each runs as a subprocess in the fixed
environment of snippets/_runner.py and its stdout must equal the .out beside it.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from engine.tools.edition import parse_directive, strip_html_comments
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
    if not runner.matches(recorded, actual) or changed:
        pytest.fail(
            f"{path} no longer prints or returns what the book recorded:\n\n"
            f"{runner.diff(path, recorded, actual)}{changed}\n{runner.regen_hint(path)}",
            pytrace=False,
        )
    sidecar = runner.results_path(path)
    if sidecar.exists():  # byte for byte, as make regen writes it
        assert sidecar.read_text() == runner.results_text(results), runner.regen_hint(path)


def test_experiments_use_only_the_standard_library() -> None:
    offenders = {}
    for path, _, number in experiments():
        allowed = set(sys.stdlib_module_names) | {"__future__"} | NON_STDLIB.get(number, set())
        extra = runner.imported_modules(path) - allowed
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


def is_excerpt(path: str) -> bool:
    """An engine or experiment excerpt by name, not a whole snippet or output file."""
    return parse_directive(f'--8<-- "{path}"') is not None


def page_includes() -> dict[str, list[str]]:
    """Every snippet include of every page (engine excerpts are checked elsewhere).
    HTML comments are blanked first: what a comment holds is not shown."""
    includes = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        text = strip_html_comments(page.read_text())
        paths = [p for p in INCLUDE.findall(text) if not is_excerpt(p)]
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
        if not m or is_excerpt(m["path"]):
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
        if not OUTPUT_BLOCK.match(block_of(lines, i)):
            problems.append(f"line {i + 1}: {path} is not inside an '??? output' block")
    return problems


def block_of(lines: list[str], i: int) -> str:
    """The line that opens the block line ``i`` sits in (past its code fence), or ''."""
    indent = len(lines[i]) - len(lines[i].lstrip())
    j = i - 1
    while j >= 0 and (not lines[j].strip() or FENCE_OPEN.match(lines[j])):
        j -= 1
    while j >= 0 and (not lines[j].strip() or len(lines[j]) - len(lines[j].lstrip()) >= indent):
        j -= 1
    return lines[j] if j >= 0 else ""


LISTING_BLOCK = re.compile(r"^\s*\?\?\? listing\b")  # folded: ???+ would open it
PREDICT_BLOCK = re.compile(r"^\s*(\?\?\?\+?|!!!) predict\b")


def reading_path_problems(markdown: str) -> list[str]:
    """The reading path of an experiment: its setup, then its Predict box, then the
    functions that carry the idea, its whole file folded in a '??? listing' block,
    and its output. A Predict box after the listing, or a listing in the open,
    would put 2,000 px of code between the question and the reader."""
    lines = strip_html_comments(markdown).splitlines()
    problems, listed, predicted = [], False, False
    for i, line in enumerate(lines):
        if PREDICT_BLOCK.match(line):
            predicted = True
        m = INCLUDE.match(line)
        if not m or is_excerpt(m["path"]):
            continue
        path = m["path"]
        if path.endswith(".out"):
            if predicted and listed:
                problems.append(f"line {i + 1}: a Predict box stands after {path[:-4]}.py")
            listed, predicted = False, False
            continue
        if not path.endswith(".py"):
            continue
        listed = True
        if not LISTING_BLOCK.match(block_of(lines, i)):
            problems.append(f"line {i + 1}: {path} is not folded in a '??? listing' block")
        if runner.EXPERIMENT.match(path) and not predicted:
            problems.append(f"line {i + 1}: {path} has no Predict box before its listing")
        predicted = False
    return problems


def on_every_page(check) -> str:
    """What ``check`` finds on each page of the book, one line a problem."""
    return "\n".join(
        f"{page.relative_to(ROOT)}: {p}"
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for p in check(page.read_text())
    )


def test_every_experiment_asks_before_it_shows_its_code() -> None:
    problems = on_every_page(reading_path_problems)
    assert not problems, problems


def test_every_output_sits_in_its_experiments_output_block() -> None:
    problems = on_every_page(misplaced_outputs)
    assert not problems, problems


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


def test_the_reading_path_check_catches_each_way_to_break_it() -> None:
    listing = (
        '??? listing "The whole file: e01_x.py"\n'
        '    ```python title="snippets/ch01/e01_x.py"\n'
        '    --8<-- "snippets/ch01/e01_x.py"\n'
        "    ```\n\n"
    )
    output = '??? output "Output"\n    ```text\n    --8<-- "snippets/ch01/e01_x.out"\n    ```\n'
    predict = '!!! predict "Predict"\n    How many?\n\n'
    excerpt = '--8<-- "snippets/ch01/e01_x.py::step"\n\n'
    assert reading_path_problems(predict + excerpt + listing + output) == []
    late = reading_path_problems(listing + predict + output)
    assert any("has no Predict box before its listing" in p for p in late), late
    assert any("a Predict box stands after" in p for p in late), late
    open_listing = listing.replace('??? listing "The whole file: e01_x.py"\n', "").replace(
        "    ", ""
    )
    unfolded = reading_path_problems(predict + open_listing + output)
    assert any("is not folded" in p for p in unfolded), unfolded
    opened = reading_path_problems(
        predict + listing.replace("??? listing", "???+ listing") + output
    )
    assert any("is not folded" in p for p in opened), opened


EXCERPT_LINES = 40  # a quoted function reads whole on a desktop screen
# Excerpts allowed past that, and why; each is a debt to pay, not a precedent.
LONG_EXCERPTS = {
    "engine/csrc/paged_attention.cpp:one_kv_head": "the C++ decode op's whole loop nest, "
    "59 lines; to be split into its score and value halves",
}


def test_every_excerpt_reads_whole_on_a_screen() -> None:
    from engine.tools.edition import collect

    long = []
    for e in collect(ROOT):  # every excerpt every page shows, as the edition records it
        ref = f"{e['file']}{'::' if e['kind'] == 'name' else ':'}{e['name']}"
        lines = len(e["text"].splitlines())
        if lines > EXCERPT_LINES and ref not in LONG_EXCERPTS:
            long.append(f"docs/{e['page']}: {ref} is {lines} lines")
    assert not long, f"excerpts over {EXCERPT_LINES} lines:\n" + "\n".join(long)
