"""A page may show only what it got from a source. Each way a page could show
false content and still pass is tried here on a copy of a real chapter, and
each must be caught: by the build, or by the snippet tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_snippets import misplaced_outputs, page_includes

CH01 = ROOT / "docs" / "ch01-batching-and-the-kv-cache.md"
E01_OUT = '    --8<-- "snippets/ch01/e01_kv_cache_macs.out"'
E02_OUT = '    --8<-- "snippets/ch01/e02_decode_roofline.out"'


def load_hook():
    spec = importlib.util.spec_from_file_location("book_hook", ROOT / "docs" / "hooks" / "book.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load_hook()


def fence_problems(markdown: str) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    hook.check_fences(markdown, lambda line, message: found.append((line, message)))
    return found


def test_real_pages_pass() -> None:
    for page in sorted((ROOT / "docs").rglob("*.md")):
        assert fence_problems(page.read_text()) == [], page


def test_pasted_output_with_the_include_in_a_comment_is_caught() -> None:
    text = CH01.read_text()
    recorded = (ROOT / "snippets/ch01/e01_kv_cache_macs.out").read_text()
    pasted = "    ```text\n" + "".join(f"    {ln}\n" for ln in recorded.splitlines())
    faked = text.replace(f"    ```text\n{E01_OUT}\n", f"<!--\n{E01_OUT}\n-->\n{pasted}")
    assert faked != text
    assert any("must hold one snippet include" in m for _, m in fence_problems(faked))
    # and the commented-out include no longer counts as showing the output
    assert "snippets/ch01/e01_kv_cache_macs.out" in "".join(page_includes()["docs/" + CH01.name])
    stripped = hook.strip_html_comments(faked)
    assert E01_OUT not in stripped


def test_swapped_outputs_are_caught() -> None:
    text = CH01.read_text()
    swapped = text.replace(E01_OUT, "@@").replace(E02_OUT, E01_OUT).replace("@@", E02_OUT)
    problems = misplaced_outputs(swapped)
    assert any("e01_kv_cache_macs.out does not follow" in p for p in problems), problems
    assert any("e02_decode_roofline.out does not follow" in p for p in problems), problems


def test_output_outside_its_output_block_is_caught() -> None:
    text = CH01.read_text()
    folded = '??? output "Output, and what it shows"\n    ```text\n' + E01_OUT
    moved = text.replace(folded, f"```text\n{E01_OUT[4:]}")
    assert moved != text
    assert any("not inside an '??? output' block" in p for p in misplaced_outputs(moved))


def test_literal_python_instead_of_an_excerpt_is_caught() -> None:
    text = CH01.read_text().replace(
        '--8<-- "engine/llm.py::LLM.generate"',
        "```python\ndef generate(self, prompts):\n    return []\n```",
    )
    assert any(
        "```python block must hold one snippet include" in m for _, m in fence_problems(text)
    )


def test_include_of_an_arbitrary_file_is_caught() -> None:
    text = CH01.read_text() + '\n```text\n--8<-- "snippets/models/RECORDS.md"\n```\n'
    problems = fence_problems(text)
    assert any("is not a snippet, output or result file" in m for _, m in problems), problems


@pytest.mark.parametrize("language", ["bash", "console", "mermaid"])
def test_commands_and_diagrams_may_be_written_in_the_page(language: str) -> None:
    assert fence_problems(f"```{language}\nmake test\n```\n") == []


def test_the_strict_build_fails_and_names_each_page_and_line(tmp_path: Path) -> None:
    """One build of a copy of the book with several defects: every one is reported."""
    site = tmp_path / "book"
    shutil.copytree(ROOT / "docs", site / "docs", ignore=shutil.ignore_patterns("assets"))
    for folder in ("engine", "snippets"):
        shutil.copytree(
            ROOT / folder, site / folder, ignore=shutil.ignore_patterns("*.safetensors")
        )
    shutil.copy(ROOT / "mkdocs.yml", site / "mkdocs.yml")
    (site / "docs" / "assets").mkdir()
    page = site / "docs" / "index.md"
    lines = len(page.read_text().splitlines())
    page.write_text(
        page.read_text()
        + '\n--8<-- "engine/tools/edition.py::no_such_function"\n'  # +2
        + '\nWe saw {{ result("ch01/e02_decode_roofline", "no_such_value") }} tokens.\n'  # +4
        + "\n```text\npasted 303\n```\n"  # +6
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "out")],
        cwd=site,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0, log
    assert f"docs/index.md:{lines + 2}: excerpt" in log and "no_such_function" in log, log
    assert f"docs/index.md:{lines + 4}: " in log and "no_such_value" in log, log
    assert f"docs/index.md:{lines + 6}: a ```text block must hold one snippet include" in log, log
