"""The built book, opened in headless Chromium as a reader would open it.

The site is built with `mkdocs build --strict`, served on 127.0.0.1 on a free
port, and driven through Playwright with a system Chromium, /usr/bin/chromium
unless $CHROMIUM names another (no browser download). Every request that
leaves 127.0.0.1 is blocked and counted: the book must work with no network.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.conftest import ARTIFACTS, ROOT

pytestmark = pytest.mark.browser
CHROMIUM = Path(os.environ.get("CHROMIUM", "/usr/bin/chromium"))
# Flags for a root, headless, offline machine: no sandbox, and no background
# traffic to Google's services that a closed network would refuse.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args) -> None:  # noqa: A002
        pass


@pytest.fixture(scope="module")
def site_url(tmp_path_factory) -> Iterator[str]:
    out = tmp_path_factory.mktemp("site")
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=out))
    url = f"http://127.0.0.1:{server.server_address[1]}/"
    # Instant navigation only follows links whose origin matches the sitemap's,
    # so the site is built for the port it is served on.
    subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(out)],
        cwd=ROOT,
        check=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "SITE_URL": url},
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield url
    server.shutdown()


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs /usr/bin/chromium as root")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, site_url):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.errors = []  # console errors and uncaught exceptions
    page.offsite = []  # requests that tried to leave the machine
    page.on("console", lambda m: m.type == "error" and page.errors.append(m.text))
    page.on("pageerror", lambda e: page.errors.append(str(e)))

    def route(r):
        if urlparse(r.request.url).hostname in ("127.0.0.1", None):
            return r.continue_()
        page.offsite.append(r.request.url)
        return r.abort()

    page.route("**/*", route)
    # Material renders Mermaid into a closed shadow root; open it so the test can see the SVG.
    page.add_init_script(
        "const attach = Element.prototype.attachShadow;"
        "Element.prototype.attachShadow = function (o) { return attach.call(this, {...o, mode: 'open'}); };"
    )
    yield page
    context.close()


def test_reader_session(page, site_url) -> None:
    page.goto(site_url)
    page.wait_for_load_state("networkidle")

    # A Mermaid diagram on the Preface renders as SVG.
    page.locator("div.mermaid svg").first.wait_for(timeout=15_000)
    # Code blocks carry a copy button.
    assert page.locator("button[data-clipboard-target]").count() > 0

    # Instant navigation: the page changes without a full load, so a marker survives.
    page.evaluate("window.__sameDocument = true")
    page.locator("nav.md-nav--primary a", has_text="Batching, attention").first.click()
    page.wait_for_url("**/ch01-batching-and-the-kv-cache/")
    page.locator("h1", has_text="Batching costs").wait_for()
    assert page.evaluate("window.__sameDocument === true"), "navigation reloaded the page"

    # Math renders (KaTeX, vendored) on the page reached by instant navigation.
    page.locator(".arithmatex .katex").first.wait_for(timeout=10_000)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "site-chapter-1.png"))

    # Search for a word from Chapter 1 finds Chapter 1.
    page.keyboard.press("/")
    page.keyboard.type("multiply")
    # Results arrive while the query is still being typed ("m" first), so wait
    # for the result list of the whole word: its links carry the query as ?h=.
    result = page.locator('.md-search-result__item a[href*="h=multiply"]').first
    result.wait_for(timeout=10_000)
    assert "ch01-batching-and-the-kv-cache" in result.get_attribute("href")
    page.screenshot(path=str(ARTIFACTS / "site-search.png"))

    assert not page.errors, f"console errors: {page.errors}"
    assert not page.offsite, f"requests left the machine: {page.offsite}"


def test_dark_mode_toggle_and_preface_edition(page, site_url) -> None:
    page.goto(site_url)
    scheme = page.evaluate("document.body.getAttribute('data-md-color-scheme')")
    page.locator("label.md-header__button[for^='__palette']:visible").first.click()
    # The theme applies the new scheme from an event handler: wait for it, and
    # fail if it never comes.
    page.wait_for_function(
        "s => document.body.getAttribute('data-md-color-scheme') !== s", arg=scheme, timeout=5_000
    )
    assert "Edition" in page.locator(".md-copyright .edition").inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "site-preface-toggled.png"))
    assert not page.errors, f"console errors: {page.errors}"
    assert not page.offsite, f"requests left the machine: {page.offsite}"
