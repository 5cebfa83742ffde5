"""What the snippets' source must promise, beyond printing what the book recorded.

- Each defines main(), which prints and returns its named results, and runs it
  only under `if __name__ == "__main__":`, so the runner can keep what it returns.
- No figure is typed into printed text: digits in the literal parts of print()
  arguments and of f-strings must come from constants, not from the author.
- Output lines fit a phone's output block.
- The standard-library experiments run on the oldest Python a reader may have.
"""

from __future__ import annotations

import ast
import glob
import os
import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT, load_runner

runner = load_runner()
SNIPPETS = runner.discover()
EXPERIMENTS = [p for p in SNIPPETS if runner.EXPERIMENT.match(p)]
SOURCES = SNIPPETS + [p.relative_to(ROOT).as_posix() for p in runner.plot_scripts()]

# The widest output line a 390-px phone shows without scrolling.
OUTPUT_WIDTH = 56
# Words whose digits are part of a name, not a figure: number formats, hashes,
# and the published names of GPUs, links and models.
NAMED_DIGITS = re.compile(
    r"\b(?:bf16|fp8|fp16|fp32|float16|float32|float64|int64|sha256|utf-8"
    r"|[ABH]\d{3}|Gen\d|x16|Llama-[\d.]+-\d+B|Qwen\d(?:-[\d.]+B)?|DeepSeek-V\d(?:\.\d)?)\b",
    re.I,
)
# (snippet, text) -> why a digit may stand in its printed text.
ALLOWED_PRINTED: dict[tuple[str, str], str] = {}


def tree(path: str) -> ast.Module:
    return ast.parse((ROOT / path).read_text(), filename=path)


@pytest.mark.parametrize("path", SNIPPETS, ids=SNIPPETS)
def test_snippet_defines_main_and_runs_it_only_as_a_script(path: str) -> None:
    module = tree(path)
    functions = {n.name for n in module.body if isinstance(n, ast.FunctionDef)}
    assert "main" in functions, f"{path} has no main() to return its results"
    last = module.body[-1]
    guard = (
        isinstance(last, ast.If)
        and ast.unparse(last.test) in ('__name__ == "__main__"', "__name__ == '__main__'")
        and ast.unparse(last.body[0]).strip() == "main()"
    )
    assert guard, f'{path} must end with: if __name__ == "__main__": main()'


def literal_parts(node: ast.AST) -> list[str]:
    """The author-typed text of an expression: its string constants and the
    literal parts of its f-strings, never a replacement field's format spec."""
    if isinstance(node, ast.Constant):
        return [node.value] if isinstance(node.value, str) else []
    if isinstance(node, ast.FormattedValue):
        return literal_parts(node.value)
    return [t for child in ast.iter_child_nodes(node) for t in literal_parts(child)]


def typed_figures(path: str) -> list[str]:
    module = tree(path)
    specs = {id(n.format_spec) for n in ast.walk(module) if isinstance(n, ast.FormattedValue)}
    texts: list[tuple[int, str]] = []
    for node in ast.walk(module):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            # plain strings here; the f-strings among the arguments come next
            plain = [a for a in ast.walk(node) if isinstance(a, ast.Constant)]
            inner = {
                id(c) for j in ast.walk(node) if isinstance(j, ast.JoinedStr) for c in j.values
            }
            texts += [
                (a.lineno, a.value)
                for a in plain
                if isinstance(a.value, str) and id(a) not in inner
            ]
        elif isinstance(node, ast.JoinedStr) and id(node) not in specs:
            texts += [(node.lineno, t) for t in literal_parts(node)]
    return sorted(
        {
            f"{path}:{line}: {text!r}"
            for line, text in texts
            if re.search(r"\d", NAMED_DIGITS.sub("", text)) and (path, text) not in ALLOWED_PRINTED
        }
    )


@pytest.mark.parametrize("path", SOURCES, ids=SOURCES)
def test_no_figure_is_typed_into_printed_text(path: str) -> None:
    typed = typed_figures(path)
    assert not typed, (
        "digits typed into printed text; build the label from the constant it describes "
        "(f'{NUM_BLOCKS} blocks'), or allow it in tests/test_snippet_sources.py:\n"
        + "\n".join(typed)
    )


def test_the_literal_check_spares_format_specs() -> None:
    source = 'N = 11\nprint(f"{N:>4} blocks", "of", f"{N * 2:,.1f}")\nprint("with 11 blocks")\n'
    module = ast.parse(source)
    found = [t for n in ast.walk(module) if isinstance(n, ast.Call) for t in literal_parts(n)]
    assert " blocks" in found and "with 11 blocks" in found
    assert not any("4" in t or "1f" in t for t in found if t != "with 11 blocks")


@pytest.mark.parametrize("path", SNIPPETS, ids=SNIPPETS)
def test_output_fits_a_phone(path: str) -> None:
    record = runner.record_path(path)
    wide = [
        f"{record.name}:{n}: {len(line)} columns"
        for n, line in enumerate(record.read_text().splitlines(), 1)
        if len(line) > OUTPUT_WIDTH
    ]
    assert not wide, f"lines wider than {OUTPUT_WIDTH} columns:\n" + "\n".join(wide)


def oldest_python() -> str | None:
    """Python 3.9 (macOS's system Python): from $PYTHON_OLDEST, PATH, or pyenv."""
    pyenv = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.9*/bin/python")))
    candidates = [os.environ.get("PYTHON_OLDEST"), *pyenv[-1:], shutil.which("python3.9")]
    for python in filter(None, candidates):
        probe = subprocess.run(
            [python, "-c", "import sys; print(sys.version_info[:2])"],
            capture_output=True,
            text=True,
        )
        if probe.returncode == 0 and probe.stdout.strip() == "(3, 9)":
            return python
    return None


@pytest.mark.parametrize("path", EXPERIMENTS, ids=EXPERIMENTS)
def test_experiment_runs_on_the_oldest_python(path: str) -> None:
    python = oldest_python()
    if python is None:
        pytest.skip("no Python 3.9 here; ruff checks the experiments' syntax for py39 instead")
    stdout, results = runner.run(path, python=python)
    assert stdout == runner.record_path(path).read_text(), f"{path} prints otherwise on {python}"
    assert results == runner.recorded_results(path), f"{path} returns otherwise on {python}"
