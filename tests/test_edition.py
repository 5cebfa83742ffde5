"""Excerpts by name, the edition manifest, and `deepinfer edition check`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.tools import edition
from engine.tools.cli import main as cli_main
from tests.conftest import ROOT


def test_manifest_is_fresh() -> None:
    recorded = json.loads((ROOT / edition.MANIFEST).read_text())["excerpts"]
    current = edition.collect(ROOT)
    stale = [e for e in current if e not in recorded] + [e for e in recorded if e not in current]
    assert recorded == current, (
        "docs/edition.json is stale; run `make regen`. Entries that differ:\n"
        + "\n".join(json.dumps(e) for e in stale)
    )


def test_every_section_the_engine_marks_is_shown() -> None:
    shown = {(e["file"], e["name"]) for e in edition.collect(ROOT) if e["kind"] == "section"}
    unshown = [f"{f}:{n}" for f, n in edition.defined_sections(ROOT) if (f, n) not in shown]
    assert not unshown, "engine sections marked for the book but shown by no page: " + ", ".join(
        unshown
    )


def test_checkout_matches_its_own_edition(capsys) -> None:
    assert cli_main(["edition", "check", str(ROOT)]) == 0
    assert "match" in capsys.readouterr().out


# A small synthetic checkout, so the checker is tested on edits we control.
ENGINE = """\
class Pool:
    def allocate(self, n):
        return list(range(n))

    def free(self, blocks):
        blocks.clear()


# --8<-- [start:policy]
def victim(requests):
    return requests[-1]
# --8<-- [end:policy]
"""
PAGE = """\
# 2. Blocks

--8<-- "engine/pool.py::Pool.allocate"

--8<-- "engine/pool.py:policy"
"""


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    (tmp_path / "engine").mkdir()
    (tmp_path / "docs").mkdir()
    (tmp_path / "engine" / "pool.py").write_text(ENGINE)
    (tmp_path / "docs" / "ch02.md").write_text(PAGE)
    edition.write_manifest(tmp_path)
    return tmp_path


def check(root: Path) -> tuple[int, str]:
    return edition.check(root)


def test_unchanged_checkout_passes(checkout: Path) -> None:
    status, text = check(checkout)
    assert status == 0, text
    assert "all 2 excerpts match" in text


def test_changed_excerpt_is_reported_by_chapter(checkout: Path) -> None:
    src = checkout / "engine" / "pool.py"
    src.write_text(src.read_text().replace("list(range(n))", "list(range(n + 1))"))
    status, text = check(checkout)
    assert status == 1
    assert "2. Blocks  [ch02.md]" in text
    assert "changed   Pool.allocate" in text
    assert "policy" not in text


def test_moved_excerpt_is_reported(checkout: Path) -> None:
    src = checkout / "engine" / "pool.py"
    src.write_text('"""A docstring pushes everything down."""\n\n' + src.read_text())
    status, text = check(checkout)
    assert status == 1
    assert "moved     Pool.allocate  (engine/pool.py lines 2-3 -> engine/pool.py lines 4-5)" in text
    assert "moved     policy" in text


def test_excerpt_moved_to_another_file_is_found(checkout: Path) -> None:
    src = checkout / "engine" / "pool.py"
    text = src.read_text()
    start = text.index("# --8<-- [start:policy]")
    src.write_text(text[:start])
    (checkout / "engine" / "policy.py").write_text(text[start:])
    status, report = check(checkout)
    assert status == 1
    assert "moved     policy  (engine/pool.py lines 10-11 -> engine/policy.py lines 2-3)" in report


def test_vanished_excerpt_is_reported(checkout: Path) -> None:
    src = checkout / "engine" / "pool.py"
    src.write_text(src.read_text().replace("def allocate", "def reserve"))
    status, text = check(checkout)
    assert status == 1
    assert "vanished  Pool.allocate" in text


def test_cli_exit_status_and_bad_path(checkout: Path, tmp_path_factory) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    ok = subprocess.run(
        [sys.executable, "-m", "engine.tools.cli", "edition", "check", str(checkout)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    empty = tmp_path_factory.mktemp("empty")
    bad = subprocess.run(
        [sys.executable, "-m", "engine.tools.cli", "edition", "check", str(empty)],
        capture_output=True,
        text=True,
        env=env,
    )
    assert bad.returncode == 2
    assert "not a DeepInfer checkout" in bad.stderr


def test_qualified_names_include_decorators_and_dedent(tmp_path: Path) -> None:
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "m.py").write_text(
        textwrap.dedent("""\
        class A:
            @staticmethod
            def f():
                return 1
        """)
    )
    ex = edition.extract(tmp_path, "engine/m.py", "A.f", "name")
    assert (ex.start, ex.end) == (2, 4)
    assert ex.text == "@staticmethod\ndef f():\n    return 1\n"


def test_changed_excerpt_shows_a_diff(checkout: Path) -> None:
    src = checkout / "engine" / "pool.py"
    src.write_text(src.read_text().replace("list(range(n))", "list(range(n + 1))"))
    _, text = check(checkout)
    assert "-    return list(range(n))" in text
    assert "+    return list(range(n + 1))" in text


def test_directives_inside_html_comments_are_not_collected(checkout: Path) -> None:
    page = checkout / "docs" / "ch02.md"
    page.write_text(
        page.read_text().replace(
            '--8<-- "engine/pool.py:policy"', '<!--\n--8<-- "engine/pool.py:policy"\n-->'
        )
    )
    assert [e["name"] for e in edition.collect(checkout)] == ["Pool.allocate"]


def test_a_cpp_section_is_an_excerpt_and_its_edits_are_reported(tmp_path: Path) -> None:
    (tmp_path / "engine" / "csrc").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    src = tmp_path / "engine" / "csrc" / "op.cpp"
    src.write_text(
        "int a;\n// --8<-- [start:body]\nint twice(int x) { return 2 * x; }\n// --8<-- [end:body]\n"
    )
    (tmp_path / "docs" / "ch01.md").write_text('# 1. Op\n\n--8<-- "engine/csrc/op.cpp:body"\n')
    edition.write_manifest(tmp_path)
    [entry] = json.loads((tmp_path / edition.MANIFEST).read_text())["excerpts"]
    assert (entry["file"], entry["name"], entry["lines"]) == ("engine/csrc/op.cpp", "body", [3, 3])
    assert {"twice", "x"} <= edition.defined_names(tmp_path)
    with pytest.raises(edition.ExcerptError, match="not Python"):
        edition.extract(tmp_path, "engine/csrc/op.cpp", "twice", "name")
    src.write_text(src.read_text().replace("2 * x", "x + x"))
    code, out = edition.check(tmp_path)
    assert code == 1 and "changed" in out and "op.cpp" in out
