"""The chapter notebooks (docs/hooks/notebooks.py).

Each notebook is run as a reader would run it, in a python3 kernel of this
environment (ipykernel, driven by nbclient), and every experiment's cell must print
exactly the output the book records, which is also the output the notebook ships
with. Its markdown must carry each experiment's heading and Predict box as the page
shows them. The built site must serve each notebook as the build made it, link it
from its chapter's page and from the experiments page, and the experiments page's
Run links must land on each experiment's listing, where the Run button is.
"""

from __future__ import annotations

import copy
import difflib
import re
import textwrap
from functools import cache
from pathlib import Path
from urllib.parse import urljoin, urlparse

import nbformat
import pytest
from nbclient import NotebookClient

from engine.tools.results import substitute
from tests.conftest import ROOT, load_runner, load_script
from tests.html_tree import Element, parse

runner = load_runner()
hook = load_script(ROOT / "docs" / "hooks" / "notebooks.py", "notebooks_hook")
CHAPTERS = hook.chapters()
SITE_URL = "http://127.0.0.1:8000/"
CELL_TIMEOUT_S = 300  # one experiment, on a loaded 2-core machine
EXPERIMENTS = [p for p in runner.discover() if runner.EXPERIMENT.match(p)]
# Whether each snippet runs on the standard library alone, as its Run button says.
STDLIB = {rel: e["runs_here"] for rel, e in hook._run_in_page.entries().items()}


def code_cells(nb) -> list:
    return [c for c in nb.cells if c.cell_type == "code"]


def stdout(cell) -> str:
    return "".join(o.text for o in cell.outputs if o.get("name") == "stdout")


def skipped(cell) -> bool:
    return hook.SKIP in cell.metadata.get("tags", [])


def test_every_experiment_and_demo_is_in_its_chapter_notebook() -> None:
    assert CHAPTERS, "no chapter has a notebook"
    shown = []
    for chapter in CHAPTERS:
        cells = [c.metadata["snippet"] for c in code_cells(hook.notebook(chapter, SITE_URL))]
        folder = f"snippets/ch{chapter.number:02d}/"
        assert all(rel.startswith(folder) for rel in cells), (chapter.page, cells)
        demos = [p for p in runner.discover() if p.startswith(folder + "demo_")]
        assert sorted(c for c in cells if "/demo_" in c) == demos, chapter.page
        shown += cells
    assert len(shown) == len(set(shown))
    assert sorted(p for p in shown if runner.EXPERIMENT.match(p)) == EXPERIMENTS


def test_cells_hold_each_file_unchanged_and_its_record() -> None:
    for chapter in CHAPTERS:
        nb = hook.notebook(chapter, SITE_URL)
        nbformat.validate(nb)
        for cell in code_cells(nb):
            rel = cell.metadata["snippet"]
            assert cell.source == (ROOT / rel).read_text(), rel
            assert [o.output_type for o in cell.outputs] == ["stream"], rel
            assert stdout(cell) == runner.record_path(rel).read_text(), rel
            # Only the engine's demos (and an experiment that needs more than the
            # standard library) are left for the reader's own install.
            assert skipped(cell) == (not STDLIB[rel]), rel


def _words(text: str) -> str:
    """Text compared as words: no quote marks, math delimiters or line breaks."""
    text = re.sub(r"^> ?", "", text, flags=re.M)
    return " ".join(re.sub(r"\\[()\[\]]|\$", "", text).split())


def page_predict(lines: list[str], number: int) -> tuple[str, str]:
    """Experiment ``number``'s heading and its Predict box's text, read off the page."""
    start = next(i for i, ln in enumerate(lines) if ln.startswith(f"## Experiment {number}:"))
    box = next(i for i in range(start, len(lines)) if lines[i].startswith("!!! predict"))
    end = box + 1
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
        end += 1
    return lines[start], textwrap.dedent("\n".join(lines[box + 1 : end]))


def test_markdown_shows_each_heading_and_predict_box_as_the_page_does() -> None:
    for chapter in CHAPTERS:
        page, errors = substitute(ROOT, chapter.page, (ROOT / "docs" / chapter.page).read_text())
        assert not errors
        cells = hook.notebook(chapter, SITE_URL).cells
        for i, cell in enumerate(cells):
            if cell.cell_type != "code" or "/demo_" in cell.metadata["snippet"]:
                continue
            number = int(Path(cell.metadata["snippet"]).stem[1:3])
            heading, predict = page_predict(page.splitlines(), number)
            text = cells[i - 1].source
            assert text.startswith(heading + "\n"), (number, text[:80])
            assert "\n> **Predict**\n>\n> " in text, number
            assert _words(predict) in _words(text), number
        for cell in cells:
            if cell.cell_type == "markdown":
                assert "{{" not in cell.source and "--8<--" not in cell.source, cell.id
                relative = [u for u in re.findall(r"\]\(([^)\s]+)", cell.source)
                            if not u.startswith(("http://", "https://"))]  # fmt: skip
                assert not relative, (cell.id, relative)


def test_page_markup_becomes_markdown_a_notebook_renders() -> None:
    page = [
        "Runs as in [Figure 5.1](#figure-5-1), see [Chapter 2](ch02-x.md#y), \\(k + 1\\).",
        "",
        "```mermaid",
        "flowchart TB",
        "```",
        "",
        "/// figure-caption",
        "One verify step.",
        "///",
        "",
        '!!! claim-deepseek "DeepSeek documents"',
        "    A [report](https://arxiv.org/abs/1) costs $2.",
        "",
        "\\[",
        "E = 1",
        "\\]",
    ]
    ctx = {
        "site_url": SITE_URL,
        "page_url": SITE_URL + "ch05-x/",
        "captions": hook._caption_numbers(page, 5),
    }
    assert hook.to_notebook_markdown(page, 0, ctx) == [
        f"Runs as in [Figure 5.1]({SITE_URL}ch05-x/#figure-5-1), see"
        f" [Chapter 2]({SITE_URL}ch02-x/#y), $k + 1$.",
        "",
        f"*[Figure 5.1]({SITE_URL}ch05-x/#figure-5-1), on the page: One verify step.*",
        "",
        "> **DeepSeek documents**",
        ">",
        "> A [report](https://arxiv.org/abs/1) costs \\$2.",
        "",
        "$$",
        "E = 1",
        "$$",
    ]


def kernel_env(tmp_path: Path) -> dict[str, str]:
    """The snippets' fixed environment (snippets/_runner.py), with IPython's profile
    kept out of the home directory."""
    return {**runner.fixed_env(), "IPYTHONDIR": str(tmp_path / "ipython")}


@pytest.mark.parametrize("chapter", CHAPTERS, ids=lambda c: f"ch{c.number:02d}")
def test_notebook_runs_to_its_records(chapter, tmp_path: Path) -> None:
    shipped = hook.notebook(chapter, SITE_URL)
    client = NotebookClient(
        copy.deepcopy(shipped),
        kernel_name="python3",
        timeout=CELL_TIMEOUT_S,
        resources={"metadata": {"path": str(ROOT)}},
        skip_cells_with_tag=hook.SKIP,
    )
    executed = client.execute(env=kernel_env(tmp_path))
    ran = 0
    for before, after in zip(code_cells(shipped), code_cells(executed), strict=True):
        rel = before.metadata["snippet"]
        if skipped(before):
            assert after.outputs == before.outputs, rel
            continue
        ran += 1
        kinds = {(o.output_type, o.get("name")) for o in after.outputs}
        assert kinds == {("stream", "stdout")}, (rel, after.outputs)
        recorded, printed = stdout(before), stdout(after)
        assert runner.matches(recorded, printed), "".join(
            difflib.unified_diff(
                recorded.splitlines(True), printed.splitlines(True), "recorded", "notebook"
            )
        )
    runnable = [p for p in chapter.experiments if STDLIB[p]]
    assert ran == len(runnable) > 0


# --- The built site --------------------------------------------------------------------


@cache
def _page(path: Path) -> Element:
    return parse(path.read_text())


def _html(site, url: str) -> Element:
    return _page(site.path / url / "index.html")


def _target(site, page_url: str, href: str) -> tuple[str, str]:
    """A link's target, as a path in the site and a fragment."""
    target = urlparse(urljoin(site.url + page_url, href))
    return target.path.lstrip("/"), target.fragment


def test_the_site_serves_each_notebook_and_its_chapter_links_it(site) -> None:
    for chapter in CHAPTERS:
        served = site.path / chapter.notebook
        assert served.read_text() == hook.notebook_text(chapter, site.url), chapter.notebook
        url = f"{Path(chapter.page).stem}/"
        links = [
            a
            for a in _html(site, url).find_all(lambda e: e.tag == "a" and "download" in e.attrs)
            if _target(site, url, a.attrs["href"])[0] == chapter.notebook
        ]
        assert len(links) == 1, (chapter.page, links)


def _listing_after(anchor: Element) -> Element | None:
    siblings = [c for c in anchor.parent.children if isinstance(c, Element)]
    later = siblings[siblings.index(anchor) + 1 :]
    return later[0] if later else None


def test_experiments_page_links_each_run_and_notebook(site) -> None:
    page = _html(site, "experiments")
    rows = [
        r for r in page.find_all(lambda e: e.tag == "tr") if r.find_all(lambda e: e.tag == "td")
    ]
    notebooks = {c.number: c.notebook for c in CHAPTERS}
    assert len(rows) == len(EXPERIMENTS)
    for row, rel in zip(rows, EXPERIMENTS, strict=True):
        number, chapter = int(Path(rel).stem[1:3]), int(rel[11:13])
        hrefs = [_target(site, "experiments/", a.attrs["href"]) for a in row.find_all(
            lambda e: e.tag == "a" and "href" in e.attrs)]  # fmt: skip
        run = [(p, f) for p, f in hrefs if f == f"run-experiment-{number}"]
        assert len(run) == 1, (rel, hrefs)
        (path, fragment), *_ = run
        chapter_page = _html(site, path.removesuffix("index.html"))
        anchor = chapter_page.find_all(lambda e, f=fragment: e.attrs.get("id") == f)
        listing = _listing_after(anchor[0]) if len(anchor) == 1 else None
        assert listing is not None and "listing" in listing.classes, (rel, anchor)
        names = listing.find_all(lambda e: "filename" in e.classes)
        assert [n.text() for n in names] == [rel]
        assert (notebooks[chapter], "") in hrefs, (rel, hrefs)


def test_recorded_outputs_start_folded() -> None:
    """A reader meets the Predict box before the answer: every code cell's recorded
    output is folded (JupyterLab's outputs_hidden, classic Notebook's collapsed)."""
    for chapter in CHAPTERS:
        for cell in code_cells(hook.notebook(chapter, SITE_URL)):
            assert cell.metadata["jupyter"]["outputs_hidden"] is True, cell.metadata["snippet"]
            assert cell.metadata["collapsed"] is True, cell.metadata["snippet"]


def test_each_demo_says_it_needs_a_checkouts_engine() -> None:
    for chapter in CHAPTERS:
        cells = hook.notebook(chapter, SITE_URL).cells
        for before, cell in zip(cells, cells[1:]):
            if cell.cell_type == "code" and "/demo_" in cell.metadata["snippet"]:
                assert skipped(cell) and "Needs a checkout's engine" in before.source, (
                    cell.metadata["snippet"]
                )


def test_a_build_without_site_url_links_the_published_site() -> None:
    """mkdocs.yml's default site_url, which canonical links, the sitemap and every
    notebook link start from, is where the default repository publishes, never a
    loopback address (a downloaded notebook's links went to 127.0.0.1:8000)."""
    config = (ROOT / "mkdocs.yml").read_text()
    site = re.search(r'^site_url: !ENV \[SITE_URL, "([^"]+)"\]', config, re.M)[1]
    repo = re.search(r'^repo_url: !ENV \[REPO_URL, "([^"]+)"\]', config, re.M)[1]
    owner, name = urlparse(repo).path.strip("/").split("/")
    assert site == f"https://{owner}.github.io/{name}/"
    text = hook.notebook_text(CHAPTERS[0], site)
    assert "127.0.0.1" not in text and "localhost" not in text
    assert f"{site}{Path(CHAPTERS[0].page).stem}/" in text


def test_captions_are_numbered_as_the_site_numbers_them() -> None:
    """A caption inside a recorded output's fold is an Output, numbered apart from
    the body's figures, as docs/hooks/site.py numbers them."""
    page = [
        '??? output "Output"',
        "    ![plot](x.svg)",
        "    /// figure-caption",
        "    A plot.",
        "    ///",
        "",
        "/// figure-caption",
        "A diagram.",
        "///",
    ]
    assert hook._caption_numbers(page, 5) == {2: ("output", "5.1"), 6: ("figure", "5.1")}
