"""Results in prose: placeholders resolve to recorded values and engine constants,
and every way of getting one wrong is an error that names the page and line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from engine.tools import results
from tests.conftest import ROOT, load_runner

runner = load_runner()


@pytest.fixture
def book(tmp_path: Path) -> Path:
    """A checkout with one recorded snippet and one engine constant."""
    (tmp_path / "snippets" / "ch02").mkdir(parents=True)
    (tmp_path / "snippets" / "ch02" / "demo_x.json").write_text(
        json.dumps({"hits": 1120, "share": 0.501, "names": ["r4", "r3"], "same": True})
    )
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "config.py").write_text(
        "LIMIT = 256\n\nclass Config:\n    block_size: int = 16\n    path = str(LIMIT)\n"
    )
    return tmp_path


def sub(book: Path, text: str) -> tuple[str, list[str]]:
    return results.substitute(book, "ch02.md", text)


@pytest.mark.parametrize(
    "placeholder, shown",
    [
        ('{{ result("ch02/demo_x", "hits") }}', "1120"),
        ('{{ result("ch02/demo_x", "hits", ",") }}', "1,120"),
        ('{{result("ch02/demo_x","share",".1%")}}', "50.1%"),
        ('{{ result("ch02/demo_x", "share", ".3f") }}', "0.501"),
        ('{{ result("ch02/demo_x", "names") }}', "r4, r3"),
        ('{{ result("ch02/demo_x", "same") }}', "True"),
        ('{{ engine("engine/config.py::Config.block_size") }}', "16"),
        ('{{ engine("engine/config.py::LIMIT", ",") }}', "256"),
    ],
)
def test_placeholders_become_values(book: Path, placeholder: str, shown: str) -> None:
    text, errors = sub(book, f"Before {placeholder} after.\n")
    assert errors == []
    assert text == f"Before {shown} after.\n"


@pytest.mark.parametrize(
    "placeholder, message",
    [
        ('{{ result("ch02/demo_y", "hits") }}', "has no recorded results"),
        ('{{ result("ch02/demo_x", "misses") }}', "recorded no value 'misses'"),
        ('{{ result("ch02/demo_x", "share") }}', "give a format spec"),
        ('{{ result("ch02/demo_x", "hits", ".1q") }}', "cannot format"),
        ('{{ result("demo_x", "hits") }}', "is not a snippet name"),
        ('{{ engine("engine/config.py::Config.depth") }}', "assigns no constant"),
        ('{{ engine("engine/config.py::Config.path") }}', "not a literal constant"),
        ('{{ engine("config.py::LIMIT") }}', "names no engine file"),
        ("{{ result(hits) }}", "must be a string literal"),
        ('{{ results("ch02/demo_x", "hits") }}', "write result(SNIPPET"),
    ],
)
def test_bad_placeholders_name_the_page_and_line(book: Path, placeholder: str, message) -> None:
    text, errors = sub(book, f"line one\nline two {placeholder}\n")
    assert len(errors) == 1, errors
    assert errors[0].startswith("docs/ch02.md:2: "), errors[0]
    assert message in errors[0]
    assert placeholder in text  # left as it was, never silently blank


def test_every_page_placeholder_resolves() -> None:
    """The book's own pages, as the build sees them."""
    problems = []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        page = path.relative_to(ROOT / "docs").as_posix()
        problems += results.substitute(ROOT, page, path.read_text())[1]
    assert not problems, "\n".join(problems)


def test_a_changed_value_names_the_pages_that_show_it(book: Path, monkeypatch) -> None:
    """The drift guard's message for a changed result lists where the book shows it."""
    bindings = [
        results.Binding("ch02.md", 7, "result", "ch02/demo_x", "hits", ","),
        results.Binding("ch01.md", 3, "result", "ch02/demo_x", "share", ".1%"),
    ]
    monkeypatch.setattr(results, "all_bindings", lambda root: bindings)
    message = runner.results_diff(
        "snippets/ch02/demo_x.py", {"hits": 1120, "share": 0.501}, {"hits": 1121, "share": 0.501}
    )
    assert "ch02/demo_x.hits: recorded 1120, now 1121; shown on docs/ch02.md:7" in message
    assert "share" not in message


def test_results_must_be_named_plain_values() -> None:
    with pytest.raises(ValueError, match="lowercase"):
        runner.check_results("x.py", {"Hits": 1})
    with pytest.raises(TypeError, match="not a number or string"):
        runner.check_results("x.py", {"hits": {"a": 1}})
    with pytest.raises(TypeError, match="must return a dict"):
        runner.check_results("x.py", [1, 2])
    assert runner.check_results("x.py", None) == {}


def test_a_number_that_starts_a_line_does_not_start_a_list(book: Path) -> None:
    """In a list item's continuation line, "1120. Next" would begin item 1120."""
    text, errors = sub(book, '- a run\n  {{ result("ch02/demo_x", "hits") }}. Next, and\n')
    assert errors == [] and text == "- a run\n  1120\\. Next, and\n"
    text, _ = sub(book, 'Then {{ result("ch02/demo_x", "hits") }}. Next\n')
    assert text == "Then 1120. Next\n"  # mid-line: nothing to escape
    import markdown

    html = markdown.markdown("- a run\n  1120\\. Next, and")
    assert "<ol" not in html and "1120. Next" in html


def test_a_value_that_shows_as_nothing_is_an_error(book: Path) -> None:
    (book / "snippets" / "ch02" / "demo_x.json").write_text('{"none": [], "blank": ""}')
    for name in ("none", "blank"):
        _, errors = sub(book, f'{{{{ result("ch02/demo_x", "{name}") }}}}\n')
        assert errors and "shows as nothing" in errors[0]


LIST_ITEM = re.compile(r"^\s*\d[\d,]*[.)](\s|$)")


def test_no_page_gains_a_numbered_list_from_a_value() -> None:
    """Every line that reads as a numbered-list item after substitution was one
    before it: a recorded value never opens a list (as '255. On paper' once did)."""
    gained = []
    for path in sorted((ROOT / "docs").rglob("*.md")):
        source = path.read_text()
        page = path.relative_to(ROOT / "docs").as_posix()
        shown, _ = results.substitute(ROOT, page, source)
        for n, (before, after) in enumerate(zip(source.splitlines(), shown.splitlines()), 1):
            if LIST_ITEM.match(after) and not LIST_ITEM.match(before):
                gained.append(f"docs/{page}:{n}: {after.strip()[:60]}")
    assert not gained, "\n".join(gained)
