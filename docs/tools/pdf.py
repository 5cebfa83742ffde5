"""Print the whole book to one PDF, as a reader of the printed edition gets it.

    python docs/tools/pdf.py [--site-dir site]      (what `make pdf` runs)

Builds the site with BOOK_PDF=true, which adds the print-site plugin's one-page
book (print_page/) and a footer link to the PDF on every page. Serves the site
on 127.0.0.1, opens the print page in headless Chromium ($CHROMIUM, by default
/usr/bin/chromium) with every request off the machine refused, waits until each
Mermaid diagram is drawn and all math is typeset, adds a table of contents, and
prints it to SITE_DIR/inside-deepinfer.pdf. A diagram or formula that does not
render, or a request that tries to leave the machine, fails the run.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parents[2]
PDF_NAME = "inside-deepinfer.pdf"  # the footer links this name (docs/overrides/partials)
# Flags for a root, headless, offline machine, as the browser test uses them.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Material draws diagrams into closed shadow roots; open them so they can be counted.
OPEN_SHADOWS = (
    "const attach = Element.prototype.attachShadow;"
    "Element.prototype.attachShadow = function (o) {"
    " return attach.call(this, {...o, mode: 'open'}); };"
)
RENDERED = """() => {
  const hosts = [...document.querySelectorAll('#print-site-page .mermaid')];
  const drawn = hosts.filter(h => h.shadowRoot && h.shadowRoot.querySelector('svg'));
  const math = [...document.querySelectorAll('#print-site-page .arithmatex')];
  const typeset = math.filter(m => m.querySelector('.katex'));
  return {diagrams: hosts.length, drawn: drawn.length, math: math.length, typeset: typeset.length,
          labels: drawn.map(h => h.shadowRoot.querySelector('svg').textContent).join(' ')};
}"""
# A contents list after the cover: one entry per chapter, linked to its heading.
# (The plugin's own copies the right-hand sidebar, which toc.integrate removes.)
CONTENTS = """() => {
  const nav = document.createElement('nav');
  nav.id = 'book-contents';
  nav.innerHTML = '<h1>Contents</h1><ul></ul>';
  for (const h of document.querySelectorAll('#print-site-page section.print-page > h1')) {
    const li = document.createElement('li');
    li.innerHTML = `<a href="#${h.parentElement.id}">${h.textContent.replace('¶', '')}</a>`;
    nav.querySelector('ul').appendChild(li);
  }
  document.getElementById('print-site-cover-page').after(nav);
}"""


@dataclass
class Printed:
    path: Path
    diagrams: int  # Mermaid diagrams on the print page, every one drawn
    formulas: int  # math elements, every one typeset
    labels: str  # the drawn diagrams' text, for a check that they are the book's
    seconds: float


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


def build(site_dir: Path) -> None:
    env = {**os.environ, "BOOK_PDF": "true", "NO_MKDOCS_2_WARNING": "1"}
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(site_dir)]
    subprocess.run(cmd, cwd=ROOT, check=True, env=env)


@contextlib.contextmanager
def rendered_print_page(site_dir: Path, chromium: Path, **page_options) -> Iterator:
    """SITE_DIR/print_page/ (already built), served on 127.0.0.1 and open in headless
    Chromium with every request off the machine refused, once every diagram is
    drawn and every formula typeset: the Playwright page, for printing or reading.
    A request that tried to leave the machine fails it, after the page is closed."""
    from playwright.sync_api import sync_playwright

    handler = functools.partial(_Quiet, directory=site_dir)
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    offsite: list[str] = []

    def route(r):
        if urlparse(r.request.url).hostname in ("127.0.0.1", None):
            return r.continue_()
        offsite.append(r.request.url)
        return r.abort()

    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=str(chromium), args=CHROMIUM_ARGS)
            page = browser.new_page(color_scheme="light", **page_options)
            page.route("**/*", route)
            page.add_init_script(OPEN_SHADOWS)
            page.goto(f"http://127.0.0.1:{server.server_address[1]}/print_page/")
            page.wait_for_load_state("networkidle")
            page.wait_for_function(
                f"(() => {{ const r = ({RENDERED})();"
                " return r.drawn === r.diagrams && r.typeset === r.math; })()",
                timeout=60_000,
            )
            yield page
            browser.close()
    finally:
        server.shutdown()
    if offsite:
        raise RuntimeError(f"the print page tried to leave the machine: {offsite}")


def print_book(site_dir: Path, chromium: Path) -> Printed:
    """Print SITE_DIR/print_page/ (already built) to SITE_DIR/inside-deepinfer.pdf."""
    start = time.monotonic()
    out = site_dir / PDF_NAME
    with rendered_print_page(site_dir, chromium, viewport={"width": 1200, "height": 900}) as page:
        done = page.evaluate(RENDERED)
        page.evaluate(CONTENTS)
        page.emulate_media(media="print")
        page.pdf(
            path=str(out),
            format="A4",
            margin={"top": "18mm", "bottom": "18mm", "left": "16mm", "right": "16mm"},
            print_background=True,
            outline=True,  # the headings become the PDF's bookmarks
        )
    return Printed(out, done["diagrams"], done["math"], done["labels"], time.monotonic() - start)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--site-dir", type=Path, default=ROOT / "site")
    args = parser.parse_args(argv)
    chromium = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
    if not chromium.exists():
        print(f"error: {chromium} is missing (make chromium installs it as root)", file=sys.stderr)
        return 1
    build(args.site_dir)
    printed = print_book(args.site_dir, chromium)
    size = printed.path.stat().st_size / 2**20
    print(
        f"wrote {printed.path} ({size:.1f} MiB): {printed.diagrams} diagrams drawn, "
        f"{printed.formulas} formulas typeset, in {printed.seconds:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
