"""The EPUB of the whole book (`make epub`): valid, complete, and with nothing to fetch or run.

docs/tools/epub.py builds the site with its print page, takes each chapter from it in the
system Chromium once diagrams are drawn and math typeset, and writes them as XHTML into an
EPUB. Here it is built once, checked by epubcheck, and read back: every chapter in the table
of contents, every Mermaid block as an inline SVG, math as MathML without KaTeX's HTML, the
figure and table captions of the print page, and no web address but the text's own links.
"""

from __future__ import annotations

import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from lxml import etree

from engine.tools import repo_map
from tests.conftest import ROOT, load_script

pytestmark = pytest.mark.browser
epub = load_script(ROOT / "docs" / "tools" / "epub.py", "book_epub")
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
FENCE = re.compile(r"^```mermaid\n(.*?)^```", re.M | re.S)
WEB = re.compile(r"https?://")
# Attributes whose web addresses are names, never fetched: the OPF's vocabulary prefixes.
NAMES = {("{http://www.idpf.org/2007/opf}package", "prefix")}
CAPTION = re.compile(r'<span class="caption-prefix">(.*?)</span>')


@dataclass
class Book:
    path: Path
    print_page: str  # the HTML the EPUB was made from
    files: dict[str, bytes]  # the EPUB's files by name


@pytest.fixture(scope="session")
def book(print_site: Path) -> Book:
    site_dir = print_site
    written = epub.make_epub(site_dir, CHROMIUM, site_dir / epub.EPUB_NAME)
    print(
        f"\n{epub.EPUB_NAME}: {written.path.stat().st_size / 2**20:.2f} MiB in {written.seconds:.0f} s"
    )
    with zipfile.ZipFile(written.path) as z:
        files = {name: z.read(name) for name in z.namelist()}
    return Book(written.path, (site_dir / "print_page" / "index.html").read_text(), files)


def pages(book: Book) -> dict[str, etree._Element]:
    """Every XHTML file of the EPUB, parsed (as XML: a file that is not XHTML fails here)."""
    return {n: etree.fromstring(d) for n, d in book.files.items() if n.endswith(".xhtml")}


def titles() -> list[str]:
    """The H1 of every page in mkdocs.yml's nav, and the experiments page the build writes."""
    nav = re.findall(r"^  - (\S+\.md)", (ROOT / "mkdocs.yml").read_text(), re.M)
    found = [
        re.search(r"^# (.+)$", (ROOT / "docs" / name).read_text(), re.M)[1]
        for name in nav
        if (ROOT / "docs" / name).exists()
    ]
    assert len(found) >= 10, nav
    return [*found, "Experiments"]


def test_epubcheck_finds_no_error(book) -> None:
    verdict = epub.check(book.path)
    assert verdict.returncode == 0, verdict.stdout + verdict.stderr
    assert "0 errors" in verdict.stdout or "No errors" in verdict.stdout, verdict.stdout


def test_every_chapter_is_in_the_contents(book) -> None:
    nav = pages(book)["EPUB/nav.xhtml"]
    entries = [" ".join("".join(a.itertext()).split()) for a in nav.iter(f"{epub.X}a")]
    # A title's markup (`code`, emphasis) is text in the contents.
    wanted = [" ".join(re.sub(r"[`*]", "", t).split()) for t in titles()]
    assert [t for t in wanted if t not in entries] == [], entries
    files = {a.get("href") for a in nav.iter(f"{epub.X}a")}
    assert all(f"EPUB/{f}" in book.files for f in files), files


def test_every_diagram_is_an_inline_svg(book) -> None:
    fences = [
        f for md in sorted((ROOT / "docs").glob("*.md")) for f in FENCE.findall(md.read_text())
    ]
    fences += FENCE.findall(repo_map.markdown(ROOT))  # Appendix B's, generated at build time
    svg = "{http://www.w3.org/2000/svg}svg"
    diagrams = [
        d
        for page in pages(book).values()
        for d in page.iter(f"{epub.X}div")
        if d.get("class") == "diagram" and d.find(svg) is not None
    ]
    assert len(diagrams) == len(fences) > 0
    assert all("".join(d.itertext()).strip() for d in diagrams), "a diagram without its labels"


def test_math_is_mathml_without_katex_html(book) -> None:
    formulas = len(re.findall(r'class="arithmatex"', book.print_page))
    maths = sum(len(list(p.iter(epub.MATHML + "math"))) for p in pages(book).values())
    assert maths == formulas > 0
    katex = [
        (name, node.get("class"))
        for name, page in pages(book).items()
        for node in page.iter()
        if "katex" in (node.get("class") or "")
    ]
    assert katex == [], f"KaTeX's HTML rendering in the EPUB: {katex[:5]}"


def test_captions_and_plots_come_through(book) -> None:
    text = b"".join(book.files[n] for n in book.files if n.endswith(".xhtml")).decode()
    assert CAPTION.findall(text) == CAPTION.findall(book.print_page) != []
    plots = re.findall(r'<img [^>]*src="\.\./assets/plots/([^"]+)"', book.print_page)
    assert plots and all(f"EPUB/plots/{p}" in book.files for p in plots)


def test_nothing_to_fetch_and_nothing_to_run(book) -> None:
    """A web address is allowed only as a link in the text (an <a href>); namespaces and the
    OPF's vocabulary prefixes are names."""
    for name, data in book.files.items():
        if name.endswith((".css", ".txt")) or name == "mimetype":
            assert not WEB.search(data.decode()), name
            continue
        if not name.endswith((".xhtml", ".svg", ".opf", ".ncx", ".xml")):
            continue
        root = etree.fromstring(data)
        for node in root.iter():
            if not isinstance(node.tag, str):
                continue
            assert etree.QName(node).localname != "script", f"a script in {name}"
            for key, value in node.attrib.items():
                link = (node.tag == f"{epub.X}a" and key == "href") or (node.tag, key) in NAMES
                assert link or not WEB.search(value), f"{name}: {node.tag} {key}={value}"
                assert not key.startswith("on"), f"{name}: an event handler {key}"
            if etree.QName(node).localname == "style":
                assert not WEB.search(node.text or ""), f"{name}: a web address in a style"
