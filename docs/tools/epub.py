"""The whole book as an EPUB, for e-readers and phones, from the pages the PDF prints.

    python docs/tools/epub.py [--site-dir DIR] [--out FILE] [--built]   (what `make epub` runs)

Builds the site with its print page as `make pdf` does (docs/tools/pdf.py), unless --built says
SITE_DIR already has it, opens that page in headless Chromium with every request off the machine
refused, and waits until each Mermaid diagram is drawn and all math typeset. Then it takes each
chapter's section of the page, with every diagram as the SVG Mermaid drew and every formula as
the MathML KaTeX writes beside its HTML rendering, and writes one XHTML file per chapter, the
plots as files, a table of contents and a small stylesheet (epub.css) into the EPUB. A reader
has no browser behind the book: nothing in it runs a script or loads anything from the network.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from ebooklib import epub as ebook
from lxml import etree


def _pdf_module():
    """pdf.py's build, browser flags and waits. docs/tools is not a package, so it is loaded
    by its path, once, under the name its test gives it (tests/test_pdf.py)."""
    if "book_pdf" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "book_pdf", Path(__file__).with_name("pdf.py")
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["book_pdf"] = module
        spec.loader.exec_module(module)
    return sys.modules["book_pdf"]


pdf = _pdf_module()
ROOT = pdf.ROOT
EPUB_NAME = "inside-deepinfer.epub"
STYLESHEET = Path(__file__).resolve().parent / "epub.css"
XHTML = "http://www.w3.org/1999/xhtml"
X = f"{{{XHTML}}}"
SVG = "{http://www.w3.org/2000/svg}"
MATHML = "{http://www.w3.org/1998/Math/MathML}"
# MathML's elements that hold text; between the others, text is not allowed.
MATH_TOKENS = {MATHML + t for t in ("mi", "mn", "mo", "mtext", "ms", "annotation")}
# In the live page: each drawn diagram replaces its host, with the CSS variables its style
# reads from Material's stylesheet written in; each formula keeps only its MathML. Then every
# chapter's section is serialised as XML, which keeps SVG's and MathML's names and namespaces.
SECTIONS = r"""() => {
  for (const host of document.querySelectorAll('#print-site-page .mermaid')) {
    const svg = host.shadowRoot.querySelector('svg').cloneNode(true);
    const vars = getComputedStyle(host);
    for (const style of svg.querySelectorAll('style'))
      style.textContent = style.textContent.replace(/var\((--[\w-]+)\)/g,
        (m, name) => vars.getPropertyValue(name).trim() || m);
    const figure = document.createElement('div');
    figure.className = 'diagram';
    figure.appendChild(svg);
    host.replaceWith(figure);
  }
  for (const math of document.querySelectorAll('#print-site-page .arithmatex')) {
    math.replaceChildren(math.querySelector('.katex-mathml math'));
  }
  const xml = new XMLSerializer();
  return [...document.querySelectorAll('#print-site-page section.print-page')]
    .map(s => xml.serializeToString(s));
}"""


@dataclass
class Chapter:
    name: str  # the file in the EPUB, e.g. ch01-batching-and-the-kv-cache.xhtml
    title: str
    body: etree._Element  # the chapter's <section>, cleaned
    properties: list[str]  # the manifest's: svg and mathml where the chapter has them


@dataclass
class Written:
    path: Path
    chapters: list[str]  # titles, in the book's order
    diagrams: int
    formulas: int
    seconds: float


def sections(site_dir: Path, chromium: Path) -> list[str]:
    """Each chapter's section of SITE_DIR/print_page/, drawn and typeset, as XHTML text."""
    with pdf.rendered_print_page(site_dir, chromium) as page:
        return page.evaluate(SECTIONS)


def unwrap(element: etree._Element) -> None:
    """Put an element's text and children in its place (a link that cannot work in the EPUB)."""
    parent = element.getparent()
    span = etree.Element(X + "span")
    span.text, span.tail = element.text, element.tail
    span.extend(list(element))
    parent.replace(element, span)


def plain_code(body: etree._Element) -> None:
    """Code blocks without their line-number column and anchors: one <pre> that wraps."""
    for table in body.iter(X + "table"):
        if "highlighttable" not in table.get("class", ""):
            continue
        block = table.getparent()
        label = table.find(f".//{X}th/{X}span")
        pre = table.find(f".//{X}td[@class='code']//{X}pre")
        index = block.index(table)
        block.remove(table)
        block.insert(index, pre)
        if label is not None:
            block.insert(index, label)
    for anchor in body.xpath(".//x:a[starts-with(@id, '__codelineno')]", namespaces={"x": XHTML}):
        anchor.getparent().remove(anchor) if not anchor.tail else unwrap(anchor)
    for span in body.xpath(".//x:span[starts-with(@id, '__span')]", namespaces={"x": XHTML}):
        del span.attrib["id"]


def open_details(body: etree._Element) -> None:
    """Listings and outputs open, as text: a reader may not fold, and a page must not hide."""
    for details in body.iter(X + "details"):
        details.tag = X + "div"
        details.set("class", f"details {details.get('class', '')}".strip())
        details.attrib.pop("open", None)
    for summary in body.iter(X + "summary"):
        summary.tag = X + "p"
        summary.set("class", "summary")


def relink(body: etree._Element, where: dict[str, str], plots: set[str]) -> None:
    """In-book links to the chapter file that holds the id; plots to the EPUB's copy; a link
    to the site itself (a notebook, the local server) becomes its text."""
    for a in list(body.iter(X + "a")):
        a.attrib.pop("name", None)
        a.attrib.pop("download", None)
        href = a.get("href", "")
        if href.startswith("#"):
            a.set("href", f"{where.get(href[1:], '')}{href}")
        elif not href.startswith(("https://", "http://")) or urlparse(href).hostname in (
            "127.0.0.1",
            "localhost",
        ):
            unwrap(a)
    for img in body.iter(X + "img"):
        name = Path(urlparse(img.get("src", "")).path).name
        plots.add(name)
        img.set("src", f"plots/{name}")


def fix_svg(body: etree._Element) -> None:
    """Mermaid's SVG as EPUB's schema (SVG 1.1) takes it: a role it knows, no names, no size
    on a circle, a size on every rect, and no paragraph inside a label's span."""
    for svg in body.iter(SVG + "svg"):
        if svg.get("role"):
            svg.set("role", "img")
    for named in body.xpath(".//svg:*[@name]", namespaces={"svg": SVG[1:-1]}):
        del named.attrib["name"]
    for circle in body.iter(SVG + "circle"):
        circle.attrib.pop("width", None)
        circle.attrib.pop("height", None)
    for rect in body.iter(SVG + "rect"):
        rect.set("width", rect.get("width", "0"))
        rect.set("height", rect.get("height", "0"))
    for label in body.iter(SVG + "foreignObject"):
        for p in label.iter(X + "p"):
            p.tag = X + "span"


def fix_math(body: etree._Element) -> None:
    """KaTeX's MathML as the schema takes it: no spaces between elements (KaTeX leaves thin
    ones), and an operator's name as its text rather than a row inside it."""
    for mo in list(body.iter(MATHML + "mo")):
        if len(mo):
            mo.text = "".join(mo.itertext())
            mo[:] = []
    for node in body.iter(f"{MATHML}*"):
        if node.tag not in MATH_TOKENS and node.text and node.text.isspace():
            node.text = None
        if node.getparent().tag not in MATH_TOKENS and node.tail and node.tail.isspace():
            node.tail = None


def clean(section: etree._Element) -> None:
    """What an EPUB's XHTML may not hold: the print page's own attributes, styles, scripts,
    permalinks and copy buttons."""
    section.attrib.pop("heading-number", None)
    for junk in section.xpath(
        ".//x:script | .//x:style | .//x:a[@class='headerlink'] | .//x:nav | .//x:button",
        namespaces={"x": XHTML},
    ):
        junk.getparent().remove(junk) if not junk.tail else unwrap(junk)
    for pre in section.xpath(".//x:pre[starts-with(@id, '__code_')]", namespaces={"x": XHTML}):
        del pre.attrib["id"]
    plain_code(section)
    open_details(section)
    fix_svg(section)
    fix_math(section)


def chapters(texts: list[str]) -> tuple[list[Chapter], set[str]]:
    """The serialised sections as chapters, their links resolved across files."""
    parsed = [etree.fromstring(text) for text in texts]
    names = [f"{s.get('id')}.xhtml" for s in parsed]
    where = {i: name for s, name in zip(parsed, names) for i in s.xpath(".//@id")}
    plots: set[str] = set()
    found = []
    for section, name in zip(parsed, names):
        clean(section)
        relink(section, where, plots)
        title = "".join(section.find(X + "h1").itertext()).replace("¶", "").strip()
        props = [
            p
            for p, tag in (("mathml", MATHML + "math"), ("svg", SVG + "svg"))
            if next(section.iter(tag), None) is not None
        ]
        found.append(Chapter(name, title, section, props))
    return found, plots


def xhtml(chapter: Chapter) -> bytes:
    """A chapter's whole XHTML file: the stylesheet, the title, and its section as the body."""
    html = etree.Element(X + "html", nsmap={None: XHTML, "epub": "http://www.idpf.org/2007/ops"})
    html.set("lang", "en")
    html.set("{http://www.w3.org/XML/1998/namespace}lang", "en")
    head = etree.SubElement(html, X + "head")
    etree.SubElement(head, X + "title").text = chapter.title
    etree.SubElement(head, X + "link", rel="stylesheet", type="text/css", href="epub.css")
    body = etree.SubElement(html, X + "body")
    body.append(chapter.body)
    return etree.tostring(html, xml_declaration=True, encoding="utf-8", doctype="<!DOCTYPE html>")


def plot_svg(path: Path) -> bytes:
    """A plot as the EPUB holds it: without the DTD and metadata that name web addresses."""
    tree = etree.parse(str(path), etree.XMLParser(load_dtd=False, no_network=True))
    root = tree.getroot()
    for meta in root.findall("{http://www.w3.org/2000/svg}metadata"):
        root.remove(meta)
    return etree.tostring(root, xml_declaration=True, encoding="utf-8")


class _Page(ebook.EpubHtml):
    """A chapter whose XHTML is written as given: ebooklib's own HTML parser would lower-case
    SVG's names (viewBox) and drop the namespaces."""

    def __init__(self, chapter: Chapter) -> None:
        super().__init__(uid=Path(chapter.name).stem, file_name=chapter.name, title=chapter.title)
        self.properties = list(chapter.properties)
        self._xhtml = xhtml(chapter)

    def get_content(self, default=None) -> bytes:
        return self._xhtml


def write(found: list[Chapter], plots: set[str], out: Path) -> None:
    """The EPUB: metadata from the edition, a page per chapter, the plots, nav and stylesheet."""
    import datetime
    import json

    edition = json.loads((ROOT / "docs" / "edition.json").read_text())["edition"]
    book = ebook.EpubBook()
    book.set_identifier(f"urn:deepinfer:inside-deepinfer:{edition['commit']}")
    book.set_title("Inside DeepInfer")
    book.set_language("en")
    book.add_author("The DeepInfer authors")
    style = ebook.EpubItem(
        uid="style", file_name="epub.css", media_type="text/css", content=STYLESHEET.read_bytes()
    )
    book.add_item(style)
    for name in sorted(plots):
        path = ROOT / "docs" / "assets" / "plots" / name
        book.add_item(
            ebook.EpubItem(
                uid=f"plot-{path.stem}",
                file_name=f"plots/{name}",
                media_type="image/svg+xml",
                content=plot_svg(path),
            )
        )
    pages = [_Page(chapter) for chapter in found]
    for page in pages:
        book.add_item(page)
    book.toc = [ebook.Link(c.name, c.title, Path(c.name).stem) for c in found]
    book.add_item(ebook.EpubNcx())
    nav = ebook.EpubNav(title="Contents")
    nav.add_item(style)
    book.add_item(nav)
    book.spine = ["nav", *pages]
    mtime = datetime.datetime.fromisoformat(edition["date"])
    out.parent.mkdir(parents=True, exist_ok=True)
    ebook.write_epub(str(out), book, {"mtime": mtime, "epub3_pages": False})


def make_epub(site_dir: Path, chromium: Path, out: Path) -> Written:
    """SITE_DIR's print page (already built) as the EPUB at OUT."""
    start = time.monotonic()
    texts = sections(site_dir, chromium)
    found, plots = chapters(texts)
    write(found, plots, out)
    diagrams = sum(
        len(c.body.xpath(".//x:div[@class='diagram']", namespaces={"x": XHTML})) for c in found
    )
    formulas = sum(len(list(c.body.iter(MATHML + "math"))) for c in found)
    return Written(out, [c.title for c in found], diagrams, formulas, time.monotonic() - start)


def epubcheck_command() -> list[str] | None:
    """How to run epubcheck here. Debian's /usr/bin/epubcheck is the jar itself, which runs
    only where the kernel hands jars to java (binfmt_misc, often missing in containers), so
    its jar is run with java when it is there."""
    jar = Path("/usr/share/java/epubcheck.jar")
    if jar.exists() and shutil.which("java"):
        return ["java", "-jar", str(jar)]
    found = shutil.which("epubcheck")
    return [found] if found else None


def check(path: Path) -> subprocess.CompletedProcess:
    """epubcheck's verdict on PATH: its return code is 0 only without errors."""
    command = epubcheck_command()
    if command is None:
        raise FileNotFoundError("epubcheck is missing (make epub installs it as root)")
    return subprocess.run([*command, str(path)], capture_output=True, text=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site-dir", type=Path, help="where the site is built (default: a temp)")
    parser.add_argument("--out", type=Path, default=ROOT / "site" / EPUB_NAME)
    parser.add_argument("--built", action="store_true", help="SITE_DIR has the print page")
    parser.add_argument("--check", action="store_true", help="fail unless epubcheck passes it")
    args = parser.parse_args(argv)
    chromium = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    if not chromium.exists():
        print(f"error: {chromium} is missing (make chromium installs it as root)", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="epub-site-") as tmp:
        site_dir = args.site_dir or Path(tmp)
        if not args.built:
            pdf.build(site_dir)
        written = make_epub(site_dir, chromium, args.out)
    size = written.path.stat().st_size / 2**20
    print(
        f"wrote {written.path} ({size:.1f} MiB): {len(written.chapters)} chapters, "
        f"{written.diagrams} diagrams, {written.formulas} formulas, in {written.seconds:.0f} s"
    )
    if epubcheck_command() is None and not args.check:
        print("note: epubcheck is missing: the EPUB is not validated")
        return 0
    verdict = check(written.path)
    counts = [line for line in verdict.stdout.splitlines() if line.startswith("Messages:")]
    print(f"epubcheck: {counts[0] if counts else verdict.stderr.strip()}")
    if verdict.returncode:
        print(verdict.stdout + verdict.stderr, file=sys.stderr)
    return verdict.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
