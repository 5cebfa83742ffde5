"""Every Predict box can be answered from what the page shows before it: each
value an experiment sweeps (a list constant of its snippet, such as DIMS or KS,
that it also records) is substituted into the experiment's setup or its Predict
box, so that a reader never has to open the listing to learn which widths, rates
or sizes the table will have."""

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
