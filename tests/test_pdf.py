"""The PDF of the whole book (`make pdf`): every chapter, and its diagrams drawn.

docs/tools/pdf.py builds the site with its print page and prints that page with
the system Chromium. The PDF is read back with pypdf: each page of the nav must be
in it by its title, every Mermaid block of the pages must have been drawn, and the
words of the diagrams must be text in the PDF, not a blank or an error box.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from engine.tools import repo_map
from tests.conftest import ARTIFACTS, ROOT, load_script

pytestmark = pytest.mark.browser
pdf = load_script(ROOT / "docs" / "tools" / "pdf.py", "book_pdf")
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
FENCE = re.compile(r"^```mermaid\n(.*?)^```", re.M | re.S)
# Node, state and participant labels: the quoted or bracketed text of a diagram.
LABEL = re.compile(r'\["?([^"\]]+)"?\]|participant \w+ as (.+)|state "([^"]+)"')


def titles() -> list[str]:
    """The H1 of every page in the book's order (mkdocs.yml's nav)."""
    nav = re.findall(r"^  - (\S+\.md)", (ROOT / "mkdocs.yml").read_text(), re.M)
    found = []
    for name in nav:
        page = ROOT / "docs" / name
        if page.exists():
            found.append(re.search(r"^# (.+)$", page.read_text(), re.M)[1])
    assert len(found) >= 10, nav
    return [*found, "Experiments"]  # the page the build generates


def words(text: str) -> str:
    """Text with markup and runs of whitespace collapsed, as PDF extraction gives it."""
    return " ".join(re.sub(r"<br/?>|`", " ", text).split())


def squash(text: str) -> str:
    return "".join(text.split())


@pytest.fixture(scope="module")
def printed(print_site: Path):
    return pdf.print_book(print_site, CHROMIUM)


def test_pdf_has_every_chapter_and_draws_every_diagram(printed) -> None:
    from pypdf import PdfReader

    reader = PdfReader(printed.path)
    text = words(" ".join(page.extract_text() for page in reader.pages))
    missing = [t for t in titles() if words(t) not in text]
    assert not missing, f"chapters missing from the PDF: {missing}"

    fences = [
        f for md in sorted((ROOT / "docs").glob("*.md")) for f in FENCE.findall(md.read_text())
    ]
    fences += FENCE.findall(repo_map.markdown(ROOT))  # Appendix B's, generated at build time
    assert printed.diagrams == len(fences), "every Mermaid block reaches the print page, drawn"
    labels = [words(next(g for g in m.groups() if g)) for f in fences for m in LABEL.finditer(f)]
    assert len(labels) > 20
    # Line breaks inside a label join its lines with or without a space: compare
    # without any.
    drawn, flat = squash(printed.labels), squash(text)
    undrawn = [label for label in labels if squash(label) not in drawn]
    assert not undrawn, f"diagram labels not drawn on the print page: {undrawn}"
    unprinted = [label for label in labels if squash(label) not in flat]
    assert not unprinted, f"diagram labels not in the PDF's text: {unprinted}"
    assert printed.formulas > 0

    ARTIFACTS.mkdir(exist_ok=True)
    (ARTIFACTS / "book.pdf").write_bytes(printed.path.read_bytes())
    print(
        f"\n{printed.path.name}: {len(reader.pages)} pages, "
        f"{printed.path.stat().st_size / 2**20:.1f} MiB, {printed.diagrams} diagrams, "
        f"printed in {printed.seconds:.0f} s"
    )


def test_pdf_build_links_the_pdf_from_every_page(printed) -> None:
    site_dir = printed.path.parent
    for html in [site_dir / "index.html", *site_dir.glob("ch*/index.html")]:
        assert 'href="../inside-deepinfer.pdf"' in html.read_text() or (
            'href="./inside-deepinfer.pdf"' in html.read_text()
            or 'href="inside-deepinfer.pdf"' in html.read_text()
        ), f"{html.relative_to(site_dir)} does not link the PDF"
