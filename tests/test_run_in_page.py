"""The Run button: a standard-library experiment, run in the reader's browser
(Pyodide in a web worker, served by the site itself), prints exactly its
recorded output, on a phone and on a desktop, with no request off the machine;
an edited experiment shows what changed; the torch experiment and the engine
demos give the command that runs them instead."""

from __future__ import annotations

import json
import sys
from urllib.parse import urlparse

import pytest

from tests.conftest import ROOT, load_runner
from tests.test_site import DESKTOP, PHONE, assert_clean, browser, load, open_page  # noqa: F401

pytestmark = pytest.mark.browser
RUNNER = load_runner()
BOOT_MS = 120_000  # Pyodide's first start on a loaded 2-core machine


def first_experiment_per_chapter() -> dict[str, str]:
    """Chapter page -> its first standard-library experiment."""
    stdlib = set(sys.stdlib_module_names)
    pages = {int(p.name[2:4]): p.stem for p in (ROOT / "docs").glob("ch[0-9][0-9]-*.md")}
    chosen: dict[str, str] = {}
    for rel in RUNNER.discover():
        m = RUNNER.EXPERIMENT.match(rel)
        if m and not (RUNNER.imported_modules(rel) - {"__future__"}) - stdlib:
            chosen.setdefault(pages[int(m["chapter"])], rel)
    return chosen


CHOSEN = first_experiment_per_chapter()


def offline(page) -> list[str]:
    """Route the whole context (its workers too): every request off the machine is refused."""
    refused: list[str] = []

    def route(r):
        if urlparse(r.request.url).hostname in ("127.0.0.1", None):
            return r.continue_()
        refused.append(r.request.url)
        return r.abort()

    page.context.route("**/*", route)
    return refused


def panel_of(page, path: str):
    listing = page.locator("details", has=page.locator(f'span.filename:text-is("{path}")'))
    return listing.locator("xpath=following-sibling::div[contains(@class, 'run-panel')][1]")


def run(panel) -> str:
    panel.locator(".run-button").click()
    panel.locator(".run-status[data-same]").wait_for(timeout=BOOT_MS)
    return panel.locator(".run-status").get_attribute("data-same")


def test_every_chapter_has_a_runnable_experiment() -> None:
    assert len(CHOSEN) >= 5, CHOSEN


@pytest.mark.parametrize("page_name", sorted(CHOSEN))
def test_run_prints_the_recorded_output(open_page, site, page_name: str) -> None:  # noqa: F811
    path = CHOSEN[page_name]
    width = PHONE if sorted(CHOSEN).index(page_name) % 2 else DESKTOP
    page = open_page(width)
    refused = offline(page)
    load(page, site.url + page_name + "/")
    panel = panel_of(page, path)
    assert run(panel) == "true", panel.inner_text()
    shown = panel.locator(".run-output").text_content()
    assert shown == RUNNER.record_path(path).read_text()
    assert not refused, refused
    assert_clean(page)


def test_an_edited_experiment_shows_what_changed(open_page, site) -> None:  # noqa: F811
    page_name = sorted(CHOSEN)[0]
    path = CHOSEN[page_name]
    page = open_page(DESKTOP)
    load(page, site.url + page_name + "/")
    panel = panel_of(page, path)
    assert run(panel) == "true"
    editor = panel.locator("textarea")
    editor.fill(editor.input_value() + '\nprint("one more line")\n')
    assert run(panel) == "false"
    assert "+ one more line" in panel.locator(".run-diff").text_content()
    assert_clean(page)


def test_what_cannot_run_here_gives_its_command(open_page, site) -> None:  # noqa: F811
    index = json.loads((site.path / "assets" / "experiments" / "index.json").read_text())
    assert index["pyodide"], "the site was built without Pyodide (make installs it with npm)"
    local = [p for p, e in index["files"].items() if not e["runs_here"]]
    assert local and all(index["files"][p]["command"].endswith(p) for p in local)
    demo = next(p for p in local if "/demo_" in p)
    chapter = int(demo.split("/")[1][2:])
    page_name = next(p.stem for p in (ROOT / "docs").glob(f"ch{chapter:02d}-*.md"))
    page = open_page(PHONE)
    load(page, site.url + page_name + "/")
    note = panel_of(page, demo)
    assert index["files"][demo]["command"] in note.text_content()
    assert_clean(page)
