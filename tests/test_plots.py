"""The plots: every committed SVG is what its script draws now, and every SVG is shown.

Each script in snippets/plots/ draws one SVG from an experiment's own functions,
and `make regen` writes it to docs/assets/plots/<stem>.svg. Here each script is
rendered again, in the runner's fixed environment, into a temporary file, and
must match the committed SVG byte for byte. An SVG with no script behind it, or
one that no page shows, fails too.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.conftest import ROOT, load_runner

runner = load_runner()
SCRIPTS = runner.plot_scripts()
IMAGE = re.compile(r"\]\((?:\.\./)*assets/plots/(?P<name>[\w.-]+\.svg)\)")


def rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("script", SCRIPTS, ids=[rel(s) for s in SCRIPTS])
def test_plot_is_current(script: Path, tmp_path: Path) -> None:
    target = runner.plot_target(script)
    hint = "stale plot, run make regen (or: python snippets/_runner.py regen)"
    assert target.exists(), f"{rel(script)} has no committed {rel(target)}: {hint}"
    fresh = tmp_path / target.name
    runner.render_plot(script, fresh)
    if fresh.read_bytes() != target.read_bytes():
        pytest.fail(
            f"{rel(target)} differs from what {rel(script)} draws now: {hint}", pytrace=False
        )


def committed_plots() -> list[Path]:
    return sorted(runner.PLOT_DIR.glob("*.svg")) if runner.PLOT_DIR.is_dir() else []


def test_every_plot_has_a_script() -> None:
    scripts = {s.stem for s in SCRIPTS}
    orphans = [rel(p) for p in committed_plots() if p.stem not in scripts]
    assert not orphans, "plots that no script in snippets/plots/ draws:\n" + "\n".join(orphans)


def test_every_plot_is_shown_by_a_page() -> None:
    shown = {
        m["name"]
        for page in (ROOT / "docs").rglob("*.md")
        for m in IMAGE.finditer(page.read_text())
    }
    unshown = [rel(p) for p in committed_plots() if p.name not in shown]
    assert not unshown, "plots that no page shows:\n" + "\n".join(unshown)


def test_every_shown_plot_exists() -> None:
    missing = [
        f"{rel(page)}: assets/plots/{m['name']}"
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for m in IMAGE.finditer(page.read_text())
        if not (runner.PLOT_DIR / m["name"]).is_file()
    ]
    assert not missing, "pages show plots that do not exist:\n" + "\n".join(missing)


ANY_IMAGE = re.compile(r"!\[[^\]]*\]\((?P<src>[^)\s]+)|<img[^>]*\ssrc=\"(?P<html>[^\"]+)\"", re.S)


def test_every_image_a_page_shows_is_a_generated_plot() -> None:
    """A page cannot show a picture that no script draws: it could show anything."""
    strays = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        for m in ANY_IMAGE.finditer(page.read_text()):
            src = m["src"] or m["html"]
            if not IMAGE.search(f"]({src})"):
                strays.append(f"{rel(page)}: {src}")
    assert not strays, "images that no plot script draws:\n" + "\n".join(strays)


def test_a_measured_plot_names_its_machine() -> None:
    """A plot of one machine's timings says in its title which machine ran them."""
    run = json.loads((ROOT / "snippets" / "plots" / "data" / "pd_bench.json").read_text())
    svg = runner.plot_target(ROOT / "snippets" / "plots" / "pd_bench.py").read_text()
    assert run["machine"] and run["machine"] in svg
