"""Predict boxes that can be answered from above and are answered only inside the
fold. Each value an experiment sweeps (a list constant of its snippet, such as
DIMS or KS, that it also records) is substituted into the experiment's setup or
its Predict box, so that a reader never has to open the listing to learn which
widths, rates or sizes the table will have; and no page quotes a run's result
after its folded output, where a reader who has not unfolded it would read the
answer (an input the setup already gave may be quoted again)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT

EXPERIMENTS = sorted((ROOT / "snippets").glob("ch0*/e[0-9][0-9]_*.py"))


def swept(snippet: Path) -> list[str]:
    """The recorded results that are the snippet's own module-level list constants."""
    results = json.loads(snippet.with_suffix(".json").read_text()) or {}
    constants = {
        target.id
        for node in ast.parse(snippet.read_text()).body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.List)
        for target in node.targets
        if isinstance(target, ast.Name)
    }
    return [k for k, v in results.items() if isinstance(v, list) and k.upper() in constants]


def before_the_answer(snippet: Path) -> str:
    """The experiment's heading, setup and Predict box on its chapter's page."""
    number = int(snippet.stem[1:3])
    page = next((ROOT / "docs").glob(f"{snippet.parent.name}-*.md")).read_text()
    heading = re.search(rf"^## Experiment {number}\b.*$", page, re.M)
    assert heading, f"Experiment {number} has no heading"
    predict = page.index("!!! predict", heading.start())
    return page[heading.start() : page.index("\n???", predict)]


@pytest.mark.parametrize("snippet", EXPERIMENTS, ids=lambda p: p.stem)
def test_the_setup_shows_every_swept_value(snippet: Path) -> None:
    key = f"{snippet.parent.name}/{snippet.stem}"
    shown = before_the_answer(snippet)
    hidden = [name for name in swept(snippet) if f'"{key}", "{name}"' not in shown]
    assert not hidden, f"Experiment {snippet.stem}: its setup never shows {hidden}"


def test_a_sweep_is_found() -> None:
    e22 = next(p for p in EXPERIMENTS if p.stem == "e22_topk_indexer")
    assert swept(e22) == ["dims", "ks"]


OUT_INCLUDE = re.compile(r'--8<-- "snippets/(ch\d\d/\w+)\.out"')
STOP = re.compile(r"^(#|!!! predict|\?\?\? listing)")
QUOTED = re.compile(r'result\("(ch\d\d/\w+)", "(\w+)"')
# Values a page may quote after a fold without answering its Predict box, and why.
NOT_ANSWERS = {
    ("ch03/demo_async_timeline", "first_shown"): "the steps Figure 3.2 draws",
    ("ch03/demo_async_timeline", "last_shown"): "the steps Figure 3.2 draws",
}


def answers_outside_the_fold(text: str) -> list[str]:
    """Where a page first quotes one of a snippet's results after that snippet's
    folded output and before the next heading or Predict box: an answer left
    outside the fold. A value the setup already gave (an input) may be quoted again."""
    lines, found = text.splitlines(), []
    for i, line in enumerate(lines):
        if not line.startswith("??? output"):
            continue
        shown = next((m[1] for ln in lines[i + 1 : i + 4] if (m := OUT_INCLUDE.search(ln))), None)
        start = max((j for j in range(i) if lines[j].startswith("#")), default=0)
        given = {m.groups() for ln in lines[start:i] for m in QUOTED.finditer(ln)}
        end = i + 1
        while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
            end += 1
        after, box = end, False
        while after < len(lines) and not STOP.match(lines[after]):
            line = lines[after]
            box = line.startswith("!!! claim-") or (
                box and (not line.strip() or line[:4] == "    ")
            )
            for m in QUOTED.finditer(line) if not box else ():  # a claim box models, not answers
                if m[1] == shown and m.groups() not in given | NOT_ANSWERS.keys():
                    found.append(f"line {after + 1}: {shown} {m[2]}")
            after += 1
    return found


@pytest.mark.parametrize("page", sorted((ROOT / "docs").glob("*.md")), ids=lambda p: p.name)
def test_answers_sit_inside_the_fold(page: Path) -> None:
    """What a run printed is read inside its folded output, not beside it, so a
    reader who has not unfolded it has not been told the answer."""
    assert not answers_outside_the_fold(page.read_text()), page.name


def test_an_answer_outside_the_fold_is_found() -> None:
    page = (
        '??? output "Output"\n    ```text\n    --8<-- "snippets/ch08/demo_x.out"\n    ```\n\n'
        'It found {{ result("ch08/demo_x", "hits") }} hits.\n'
    )
    assert answers_outside_the_fold(page) == ["line 6: ch08/demo_x hits"]
