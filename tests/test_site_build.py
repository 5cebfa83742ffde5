"""The built site's HTML, read without a browser: titles, links, figures, glossary.

The site is built once per session (tests/conftest.py). Each test reads the pages
as a reader's browser would receive them, before any script runs.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import urljoin, urlparse

import pytest

from tests.conftest import ROOT, load_runner, load_script
from tests.html_tree import Element, parse

runner = load_runner()
hook = load_script(ROOT / "docs" / "hooks" / "site.py", "site_hook")
EXPERIMENTS = {
    int(m["number"]): path for path in runner.discover() if (m := runner.EXPERIMENT.match(path))
}
NEEDY = [e.number for e in hook.discover_experiments() if e.needs]  # beyond the stdlib
# Text a reader never sees as prose: links, code, headings and scripts.
NOT_PROSE = hook.SKIP
MENTION = re.compile(r"\bExperiments?\s+(\d+)")


@cache
def pages(site_dir: Path) -> dict[str, Element]:
    """Every built page, by the URL path the site serves it at ("" for the Preface)."""
    found = {}
    for html in sorted(site_dir.rglob("index.html")):
        rel = html.parent.relative_to(site_dir).as_posix()
        if rel.startswith(("search", "assets")):
            continue
        found["" if rel == "." else f"{rel}/"] = parse(html.read_text())
    return found


def h1(page: Element) -> str:
    heading = page.find_all(lambda e: e.tag == "h1")[0]
    return heading.text().replace("¶", "").strip()


def in_not_prose(element: Element) -> bool:
    return any(e.tag in NOT_PROSE for e in [element, *element.ancestors()])


def ids(page: Element) -> set[str]:
    return {e.attrs["id"] for e in page.iter() if "id" in e.attrs}


def test_every_chapter_page_is_built(site) -> None:
    built = pages(site.path)
    for md in sorted((ROOT / "docs").glob("*.md")):
        url = "" if md.stem == "index" else f"{md.stem}/"
        assert url in built, f"docs/{md.name} was not built"
    assert "experiments/" in built, "the generated experiments page is missing"
    assert "includes/glossary/" not in built, "the glossary is a snippet, not a page"


def test_no_macro_is_left_unrendered(site) -> None:
    """A result() call broken over two lines is not a macro to the renderer, and
    reaches the reader as its source text."""
    left = [
        f"/{url}: {text.strip()[:80]}"
        for url, page in pages(site.path).items()
        for text, element in page.texts()
        if "{{" in text and not in_not_prose(element)
    ]
    assert not left, left


def test_nav_titles_match_page_titles(site) -> None:
    """The sidebar names each page exactly as the page's own heading does."""
    wrong = []
    for url, page in pages(site.path).items():
        active = page.find_all(
            lambda e: e.tag == "a" and "md-nav__link--active" in e.classes and e.attrs["href"]
        )
        labels = {" ".join(a.text().split()) for a in active}
        if labels != {h1(page)}:
            wrong.append(f"/{url}: the nav says {sorted(labels)}, the page says {h1(page)!r}")
    assert not wrong, "nav titles that differ from their pages' titles:\n" + "\n".join(wrong)


def test_figures_and_tables_are_numbered_per_chapter(site) -> None:
    """Every plot, diagram and prose table sits in a numbered figure with a caption."""
    problems = []
    for url, page in pages(site.path).items():
        label = "P" if url == "" else _label(url)
        for kind, match in (
            ("figure", lambda e: e.tag == "img" and "plot" in e.classes),
            ("figure", lambda e: e.tag == "pre" and "mermaid" in e.classes),
            ("table", lambda e: e.tag == "table" and not _in_admonition(e)),
        ):
            for element in page.find_all(match):
                figure = next((a for a in element.ancestors() if a.tag == "figure"), None)
                if figure is None or f"book-{kind}" not in figure.classes:
                    problems.append(f"/{url}: a {kind} with no caption: {element.attrs}")
        # A figure inside a recorded output's fold is an "Output", numbered apart, so that
        # the figures of the body, seen without unfolding anything, have no gaps.
        numbers: dict[str, list[str]] = {"figure": [], "table": [], "output": []}
        for figure in page.find_all(lambda e: e.tag == "figure" and "id" in e.attrs):
            kind = figure.attrs["id"].split("-")[0]
            caption = figure.find_all(lambda e: "caption-prefix" in e.classes)
            numbers[kind].append(caption[0].text() if caption else "")
            folded = any(a.tag == "details" and "output" in a.classes for a in figure.ancestors())
            if folded != (kind == "output"):
                problems.append(
                    f"/{url}: {figure.attrs['id']} is {'in' if folded else 'out of'} a fold"
                )
        for kind, found in numbers.items():
            want = [
                f"{kind.title()} {f'{label}.' if label else ''}{i}."
                for i in range(1, len(found) + 1)
            ]
            if found != want:
                problems.append(f"/{url}: {kind}s numbered {found}, expected {want}")
    assert not problems, "\n".join(problems)


def _label(url: str) -> str | None:
    if url.startswith("architecture"):
        return "0"
    if m := re.match(r"ch(\d\d)-", url):
        return str(int(m[1]))
    if m := re.match(r"appendix-([a-z])-", url):
        return m[1].upper()
    return None


def _in_admonition(element: Element) -> bool:
    return any(
        a.tag == "details" or "admonition" in a.classes or "highlight" in a.classes
        for a in element.ancestors()
    )


def test_every_experiment_mention_is_a_link_to_its_heading(site) -> None:
    built = pages(site.path)
    problems, linked = [], 0
    for url, page in built.items():
        for text, parent in page.texts():
            if in_not_prose(parent):
                continue
            for m in MENTION.finditer(text):
                if int(m[1]) in EXPERIMENTS:
                    problems.append(f"/{url}: {m[0]!r} is not a link")
        for a in page.find_all(lambda e: "experiment-link" in e.classes):
            linked += 1
            target = urlparse(urljoin(f"/{url}", a.attrs["href"]))
            dest = built.get(target.path.lstrip("/"))
            if dest is None or target.fragment not in ids(dest):
                problems.append(
                    f"/{url}: {a.text()!r} links to {a.attrs['href']}, which is missing"
                )
    assert not problems, "\n".join(problems)
    assert linked > len(EXPERIMENTS), "the pages link almost no experiment"


def test_experiment_links_name_the_right_experiment(site) -> None:
    for url, page in pages(site.path).items():
        for a in page.find_all(lambda e: "experiment-link" in e.classes):
            number = re.search(r"\d+", a.text())[0]
            fragment = a.attrs["href"].partition("#")[2]
            assert fragment.startswith(f"experiment-{number}-"), (url, a.text(), fragment)


def test_experiments_page_lists_every_experiment(site) -> None:
    page = pages(site.path)["experiments/"]
    rows = [
        r for r in page.find_all(lambda e: e.tag == "tr") if r.find_all(lambda e: e.tag == "td")
    ]
    assert len(rows) == len(EXPERIMENTS)
    for row, (number, path) in zip(rows, sorted(EXPERIMENTS.items())):
        cells = [c for c in row.children if isinstance(c, Element) and c.tag == "td"]
        number_cell, chapter, title, *needs, command = (" ".join(c.text().split()) for c in cells)
        assert number_cell == f"Experiment {number}"
        assert chapter == f"Chapter {int(path[11:13])}", chapter
        docstring = (ROOT / path).read_text().split("\n", 1)[0]
        assert title.rstrip(".").lower() in docstring.lower(), (title, docstring)
        assert len(needs) == bool(NEEDY) and all(needs), number
        assert command == f"python {path}"
    # A Needs column only when some experiment needs more than the standard
    # library; otherwise one sentence says so instead of the same cell in every row.
    assert ("Needs" in page.text()) == bool(NEEDY)
    assert ("runs on Python's standard library alone" in page.text()) == (not NEEDY)


def test_experiments_page_tells_stdlib_from_the_rest(tmp_path) -> None:
    folder = tmp_path / "snippets" / "ch09"
    folder.mkdir(parents=True)
    (tmp_path / "snippets" / "_results.py").write_text("")
    script = folder / "e30_x.py"
    script.write_text(
        '"""Experiment 30: x."""\nfrom __future__ import annotations\nimport json\n'
        "import _results\nimport torch.nn\nfrom engine.llm import LLM\n"
    )
    import ast

    assert hook._needs(ast.parse(script.read_text()), folder) == ("engine", "torch")


def test_glossary_defines_terms_on_hover(site) -> None:
    page = pages(site.path)["ch01-batching-and-the-kv-cache/"]
    abbrs = {a.text(): a.attrs.get("title", "") for a in page.find_all(lambda e: e.tag == "abbr")}
    for term in ("KV", "GQA", "MLA", "MHA"):
        assert abbrs.get(term), f"{term} has no definition on hover"
    glossary = (ROOT / "docs" / "includes" / "glossary.md").read_text()
    terms = re.findall(r"^\*\[([^\]]+)\]: \S", glossary, re.M)
    assert {"KV", "GQA", "MLA", "TTFT", "EP", "PD"} <= set(terms)


def test_every_page_has_an_edit_link_and_a_plain_repository_link(site) -> None:
    for url, page in pages(site.path).items():
        edit = page.find_all(lambda e: e.tag == "a" and "md-content__button" in e.classes)
        if url == "experiments/":
            assert not edit, "the generated page has no file to edit"
            continue
        src = "index.md" if url == "" else f"{url.rstrip('/')}.md"
        assert edit and edit[0].attrs["href"].endswith(f"/edit/main/docs/{src}"), url
        source = page.find_all(lambda e: "md-source" in e.classes)
        # Material's source component fetches stars and forks from the host: not here.
        assert source and "data-md-component" not in source[0].attrs, url


def test_pdf_is_linked_only_from_a_pdf_build(site) -> None:
    page = pages(site.path)[""]
    assert not page.find_all(lambda e: "book-pdf" in e.classes), "a plain build has no PDF"
    assert not (site.path / "print_page").exists()


def test_licence_is_the_one_pyproject_declares() -> None:
    licence = (ROOT / "LICENSE").read_text()
    declared = re.search(r'^license = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert declared and declared[1] == "MIT"
    assert licence.startswith("MIT License")
    assert "Copyright (c) The DeepInfer authors" in licence
    assert 'THE SOFTWARE IS PROVIDED "AS IS"' in licence


@pytest.mark.parametrize(
    "html, linked",
    [
        ("<p>see Experiment 1.</p>", ["Experiment 1"]),
        (
            "<p>Experiments 1 and 2, then Experiments 1–2</p>",
            ["Experiments 1", "2", "Experiments 1", "2"],
        ),
        ("<p>Experiment 2, and 64 GB/s</p>", ["Experiment 2"]),
        ("<h2>Experiment 1: x</h2><p><code>Experiment 1</code> <a>Experiment 1</a></p>", []),
        ("<p>Experiment 99 is planned</p>", []),
    ],
)
def test_experiment_linker(html: str, linked: list[str]) -> None:
    hook._anchors.clear()
    hook._anchors.update({1: ("ch01/", "experiment-1-x"), 2: ("ch01/", "experiment-2-y")})
    out = hook.link_experiments(html, "ch02/", "test")
    assert re.findall(r'<a class="experiment-link" href="[^"]+">([^<]+)</a>', out) == linked
    assert re.sub(r"<[^>]+>", "", out) == re.sub(r"<[^>]+>", "", html)


@pytest.mark.parametrize(
    ("line", "lead"),
    [
        ('<a id="x"></a><span class="k">def</span> f():', None),
        ('<a id="x"></a>    <span class="n">x</span>', 4),
        ('<a id="x"></a><span class="w">        </span><span class="n">y</span>', 8),
        ('<a id="x"></a><span class="sd">  """doc</span>', 2),
        ('<a id="x"></a>   ', None),  # a line of spaces only
    ],
)
def test_each_indented_code_line_is_marked_with_its_indentation(line: str, lead) -> None:
    book = load_script(ROOT / "docs" / "hooks" / "book.py", "book_hooks")
    html = f'<code><span id="__span-0-1">{line}\n</span><span id="__span-0-2">x\n</span></code>'
    marked = book.mark_indents(html)
    style = f' style="--lead:{lead}ch"' if lead else ""
    assert marked == html.replace('<span id="__span-0-1">', f'<span id="__span-0-1"{style}>')


def test_a_code_line_may_break_after_punctuation_and_operators_only() -> None:
    book = load_script(ROOT / "docs" / "hooks" / "book.py", "book_hooks")
    line = (
        '<span class="n">seq</span><span class="o">.</span><span class="n">output_ids</span>'
        '<span class="p">(</span><span class="mi">1</span><span class="p">)</span>'
    )
    html = f'<code><span id="__span-0-1">{line}\n</span></code>'
    marked = book.mark_indents(html)
    assert marked.count("<wbr>") == 3 and "seq</span><wbr>" not in marked
    assert '<span class="o">.</span><wbr><span class="n">output_ids' in marked
    assert book.mark_indents(marked) == marked  # marking twice adds nothing
    assert re.sub(r"<[^>]+>", "", marked) == re.sub(r"<[^>]+>", "", html)  # the same text
