"""The built book, opened in headless Chromium as a reader would open it.

The site is built with `mkdocs build --strict` and served on 127.0.0.1 on a free
port (tests/conftest.py), and driven through Playwright with a system Chromium,
/usr/bin/chromium unless $CHROMIUM names another (no browser download). Every
request that leaves 127.0.0.1 is blocked and counted: the book must work with no
network. Reader-facing layout is measured on a 390-px phone and a 1400-px desktop,
and screenshots of both, light and dark, go to test-artifacts/ for a person to read.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.conftest import ARTIFACTS
from tests.test_snippet_sources import OUTPUT_WIDTH

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
PHONE, DESKTOP = 390, 1400
# The pages a new reader opens first; every page with a diagram is checked too.
READ_FIRST = {
    "preface": "",
    "ch01": "ch01-batching-and-the-kv-cache/",
    "ch02": "ch02-blocks-and-preemption/",
    "ch07": "ch07-correctness/",
    "ch03": "ch03-overlap/",
    "ch04": "ch04-moe/",
}
MIN_DIAGRAM_PX = 12.0  # the smallest diagram text a reader should have to read
MIN_PLOT_PX = 10.5
MIN_OUTPUT_MONO_PX = 11.0
# Material renders Mermaid into a closed shadow root; open it so the test can see the SVG.
OPEN_SHADOWS = (
    "const attach = Element.prototype.attachShadow;"
    "Element.prototype.attachShadow = function (o) {"
    " return attach.call(this, {...o, mode: 'open'}); };"
)


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test` installs /usr/bin/chromium as root")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


def new_page(browser, contexts: list, width: int = 1280, scheme: str = "light"):
    """A fresh page, in a context added to ``contexts`` (for the caller to close),
    that counts console errors and off-machine requests."""
    context = browser.new_context(viewport={"width": width, "height": 900}, color_scheme=scheme)
    contexts.append(context)
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
    page.add_init_script(OPEN_SHADOWS)
    return page


@pytest.fixture
def open_page(browser):
    """open_page(width, scheme) -> a fresh page that counts errors and off-machine requests."""
    contexts = []
    yield lambda width=1280, scheme="light": new_page(browser, contexts, width, scheme)
    for context in contexts:
        context.close()


@dataclass
class Tour:
    """The pages as loaded at one width, and what the tests measure on each."""

    pages: dict[str, dict]  # url -> {"diagrams": ..., "code": ..., "boxes": ..., ...}
    errors: list[str]  # as a page's: console errors, and requests that left the machine
    offsite: list[str]


@pytest.fixture(scope="module")
def tour(browser, site):
    """tour(width) -> every page of the nav, loaded once at that width in one page
    (light), with each page's diagram text sizes, code blocks' fit and split
    operators, and the figure boxes' and plots' text sizes of READ_FIRST's, measured
    as it is shown. The tests that look at pages at one width share one tour, instead of
    each loading the pages and drawing their diagrams again."""
    measures = {"diagrams": DIAGRAM_TEXT, "code": CODE_FIT, "split": SPLIT_TOKENS}
    first = {site.url + path for path in READ_FIRST.values()}  # their boxes measured too
    contexts, tours = [], {}

    def at(width: int) -> Tour:
        if width not in tours:
            page = new_page(browser, contexts, width)
            found = {}
            for url in sorted({*nav_pages(page, site), *first}):
                load(page, url)
                found[url] = {name: page.evaluate(js) for name, js in measures.items()}
                if url in first:
                    found[url]["boxes"] = page.evaluate(ADMONITION_TEXT)
                    found[url]["plots"] = page.evaluate(PLOT_TEXT)
            tours[width] = Tour(found, page.errors, page.offsite)
        return tours[width]

    yield at
    for context in contexts:
        context.close()


@pytest.fixture
def page(open_page):
    return open_page()


def assert_clean(page) -> None:
    assert not page.errors, f"console errors: {page.errors}"
    assert not page.offsite, f"requests left the machine: {page.offsite}"


def load(page, url: str) -> None:
    page.goto(url)
    page.wait_for_load_state("networkidle")
    if page.locator(".mermaid").count():
        page.wait_for_function(
            "[...document.querySelectorAll('.mermaid')]"
            ".every(d => d.shadowRoot && d.shadowRoot.querySelector('svg'))",
            timeout=15_000,
        )


def test_reader_session(page, site) -> None:
    site_url = site.url
    page.goto(site_url)
    page.wait_for_load_state("networkidle")

    # A Mermaid diagram on the Preface renders as SVG.
    page.locator("div.mermaid").first.wait_for(timeout=15_000)
    # Code blocks carry a copy button.
    assert page.locator("button[data-clipboard-target]").count() > 0

    # Instant navigation: the page changes without a full load, so a marker survives.
    page.evaluate("window.__sameDocument = true")
    page.locator("nav.md-nav--primary a", has_text="Batching costs").first.click()
    page.wait_for_url("**/ch01-batching-and-the-kv-cache/")
    page.locator("h1", has_text="Batching costs").wait_for()
    assert page.evaluate("window.__sameDocument === true"), "navigation reloaded the page"

    # Math renders (KaTeX, vendored) on the page reached by instant navigation.
    # (the first formula may sit in a folded output: rendered, but not visible yet)
    page.locator(".arithmatex .katex").first.wait_for(state="attached", timeout=10_000)

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

    # A glossary term explains itself on hover.
    assert page.locator("abbr[title]", has_text="KV").count() > 0
    assert_clean(page)


def test_dark_mode_toggle_and_preface_edition(page, site) -> None:
    page.goto(site.url)
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
    assert_clean(page)


# Excerpts (not recorded output) whose text is wider than the block, with the
# length of their longest line; and any whose text runs under the copy button.
CODE_FIT = """() => [...document.querySelectorAll('.md-content pre > code')]
  .filter(code => !code.closest('details.output'))
  .map(code => {
    const block = code.closest('.highlight');
    const title = block && block.querySelector('.filename');
    const lines = code.innerText.split('\\n');
    const nav = code.parentElement.querySelector('.md-code__nav');
    let covered = false;
    if (nav) {
      const button = nav.getBoundingClientRect();
      const range = document.createRange();
      range.selectNodeContents(code);
      covered = [...range.getClientRects()].some(r => r.width > 0 &&
        r.right > button.left && r.left < button.right &&
        r.bottom > button.top && r.top < button.bottom);
    }
    return {title: title ? title.textContent.trim() : code.innerText.slice(0, 40),
            scrolls: code.scrollWidth > code.clientWidth,
            longest: Math.max(...lines.map(l => l.length)), covered};
  })"""


def test_code_is_whole_on_a_desktop(tour, site) -> None:
    """At 1400 px no excerpt scrolls sideways, and the copy button covers no code."""
    shown = tour(DESKTOP)
    problems = []
    for name, path in READ_FIRST.items():
        for block in shown.pages[site.url + path]["code"]:
            if block["scrolls"]:
                problems.append(
                    f"{name}: {block['title']} scrolls sideways (longest line "
                    f"{block['longest']} columns; the engine's limit is 100)"
                )
            if block["covered"]:
                problems.append(f"{name}: the copy button covers code in {block['title']}")
    assert not problems, "\n".join(problems)
    assert_clean(shown)


# Rendered size of every text element in every diagram: its font size times the
# scale at which the SVG is drawn on screen.
DIAGRAM_TEXT = """() => [...document.querySelectorAll('.mermaid')].map((host, i) => {
  const svg = host.shadowRoot.querySelector('svg');
  let min = Infinity, text = '';
  for (const el of svg.querySelectorAll('text, foreignObject *')) {
    const own = [...el.childNodes].some(n => n.nodeType === 3 && n.textContent.trim());
    if (!own) continue;
    const ctm = (el.closest('foreignObject') || el).getScreenCTM();
    const size = parseFloat(getComputedStyle(el).fontSize) * Math.hypot(ctm.a, ctm.b);
    if (size < min) { min = size; text = el.textContent.trim(); }
  }
  const caption = host.closest('figure')?.querySelector('.caption-prefix')?.textContent;
  return {figure: caption || `diagram ${i + 1}`, min, text};
})"""


def nav_pages(page, site) -> list[str]:
    page.goto(site.url)
    hrefs = page.eval_on_selector_all(
        "nav.md-nav--primary a.md-nav__link[href]", "els => els.map(a => a.href)"
    )
    return sorted({h.split("#")[0] for h in hrefs if h.startswith(site.url)})


@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_diagram_text_is_readable(tour, site, width: int) -> None:
    shown = tour(width)
    found, small = [], []
    for url, measured in shown.pages.items():
        for d in measured["diagrams"]:
            found.append(f"{url.removeprefix(site.url) or '/'} {d['figure']} {d['min']:.1f} px")
            if d["min"] < MIN_DIAGRAM_PX:
                small.append(f"{found[-1]} ({d['text']!r})")
    record(f"diagram text at {width} px", found)
    assert len(found) >= 5, f"expected the book's diagrams, found {found}"
    assert not small, f"diagram text under {MIN_DIAGRAM_PX} px at {width} px:\n" + "\n".join(small)
    assert_clean(shown)


# Each plot's smallest text as drawn: font size in SVG units times the image's scale.
PLOT_TEXT = """async () => Promise.all([...document.querySelectorAll('img.plot')].map(async img => {
  const svg = new DOMParser().parseFromString(await (await fetch(img.src)).text(), 'image/svg+xml');
  const sizes = [...svg.querySelectorAll('text')]
    .map(t => parseFloat((t.getAttribute('style') || '').match(/font-size:\\s*([\\d.]+)/)?.[1]));
  const scale = img.getBoundingClientRect().width / svg.documentElement.viewBox.baseVal.width;
  const panel = [...svg.querySelectorAll('path, rect')]
    .some(p => /fill:\\s*#fff(fff)?\\b/.test(p.getAttribute('style') || ''));
  return {src: img.src.split('/').pop(), min: Math.min(...sizes) * scale,
          filter: getComputedStyle(img).filter, panel};
}))"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_plots_are_readable_on_a_phone_and_follow_the_scheme(open_page, tour, site, scheme) -> None:
    if scheme == "light":  # as the phone tour shows them
        shown = tour(PHONE)
        plots = [p for path in READ_FIRST.values() for p in shown.pages[site.url + path]["plots"]]
    else:
        shown, plots = open_page(PHONE, scheme), []
        for path in READ_FIRST.values():
            load(shown, site.url + path)
            plots += shown.evaluate(PLOT_TEXT)
    assert len(plots) >= 2
    record(f"plot text at {PHONE} px", [f"{p['src']} {p['min']:.1f} px" for p in plots])
    for plot in plots:
        assert plot["min"] >= MIN_PLOT_PX, f"{plot['src']}: text {plot['min']:.1f} px on a phone"
        assert not plot["panel"], f"{plot['src']} paints a white panel behind itself"
        inverted = "invert" in plot["filter"]
        assert inverted == (scheme == "dark"), f"{plot['src']} in the {scheme} scheme: {plot}"
    assert_clean(shown)


FIGURE_BOXES = "claim-code, claim-deepseek, claim-model, claim-built, predict, output, success"
ADMONITION_TEXT = f"""() => {{
  const size = el => parseFloat(getComputedStyle(el).fontSize);
  const body = size(document.querySelector('.md-content__inner > p'));
  const boxes = [...document.querySelectorAll('.md-content :is(.admonition, details)')]
    .filter(b => [{", ".join(f"'{c.strip()}'" for c in FIGURE_BOXES.split(","))}]
      .some(c => b.classList.contains(c)));
  const prose = boxes.flatMap(b => [...b.querySelectorAll('p, li')]
    .filter(p => !p.closest('pre')).map(p => ({{cls: b.className, size: size(p)}})));
  const mono = [...document.querySelectorAll('details.output pre > code')].map(size);
  return {{body, prose, mono, boxes: boxes.length}};
}}"""


@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_figure_boxes_are_not_smaller_than_body_text(tour, site, width: int) -> None:
    shown = tour(width)
    for name, path in READ_FIRST.items():
        found = shown.pages[site.url + path]["boxes"]
        small = [p for p in found["prose"] if p["size"] < found["body"]]
        assert not small, f"{name} at {width} px: text under body size {found['body']}: {small}"
        if found["mono"]:
            assert min(found["mono"]) >= MIN_OUTPUT_MONO_PX, (name, width, found["mono"])
    assert_clean(shown)


# How many monospace characters an output block shows, without scrolling, at this width.
OUTPUT_COLUMNS = """() => {
  document.querySelectorAll('details.output').forEach(d => d.open = true);
  const code = document.querySelector('details.output pre > code');
  const style = getComputedStyle(code);
  const probe = document.createElement('span');
  probe.style.position = 'absolute';
  probe.textContent = 'x'.repeat(100);
  code.appendChild(probe);
  const char = probe.getBoundingClientRect().width / 100;
  probe.remove();
  const inner = code.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
  return {columns: Math.floor(inner / char), font: style.fontSize};
}"""


def test_output_columns_on_a_phone(open_page, site) -> None:
    """Recorded outputs that answer a Predict question must be readable on a phone:
    their tables are printed to fit this many columns (recorded for the authors)."""
    page = open_page(PHONE)
    load(page, site.url + READ_FIRST["ch01"])
    fit = page.evaluate(OUTPUT_COLUMNS)
    record(f"output block at {PHONE} px", [f"{fit['columns']} columns of {fit['font']} mono"])
    assert float(fit["font"].removesuffix("px")) >= MIN_OUTPUT_MONO_PX
    assert fit["columns"] >= OUTPUT_WIDTH, (
        f"an output block shows {fit['columns']} columns; snippets print up to {OUTPUT_WIDTH}"
    )


# Whether any part of an element reaches past the screen's right edge, and the
# widest line box of each excerpt's code (none may be wider than its block).
PAST_THE_EDGE = """s => [...document.querySelectorAll(s)].map(e => {
  const r = e.getBoundingClientRect();
  return {right: r.right, wide: e.scrollWidth > e.clientWidth + 1, screen: innerWidth};
})"""


# Each indented code line's hanging indent as laid out: its indentation in
# columns, the padding and text indent it got, and the width of one column.
HANGING = """() => {
  const probe = document.createElement('code');
  probe.textContent = '0'.repeat(40);
  document.querySelector('.highlight pre').append(probe);
  const ch = probe.getBoundingClientRect().width / 40;
  probe.remove();
  const lines = document.querySelectorAll(
    '.highlight:not(details.output .highlight) code > span[style*="--lead"]');
  return [...lines].slice(0, 200).map(line => {
    const c = getComputedStyle(line);
    return {lead: parseInt(line.style.getPropertyValue('--lead')), ch,
            pad: parseFloat(c.paddingLeft), indent: parseFloat(c.textIndent)};
  });
}"""


# Operators of two or more characters that a wrapped code line split (-> read
# as a minus and a comparison).
SPLIT_TOKENS = """() => [...document.querySelectorAll('.highlight code .o')]
  .filter(o => o.textContent.length > 1 && o.getClientRects().length > 1)
  .map(o => o.textContent)"""


def test_code_and_the_experiments_fit_a_phone(open_page, tour, site) -> None:
    """On a phone an excerpt's lines wrap instead of scrolling sideways, each
    wrapped line going on right of its own indentation; the experiments table,
    Appendix B's tables and the book's figures fit the screen."""
    shown = tour(PHONE)
    problems = []
    for url, measured in shown.pages.items():  # every page's excerpts and listings
        where = url.removeprefix(site.url) or "/"
        for block in measured["code"]:
            if block["scrolls"]:
                problems.append(f"{where}: {block['title']} scrolls sideways on a phone")
        for token in measured["split"]:
            problems.append(f"{where}: the operator {token!r} is split across two lines")
    page = open_page(PHONE)
    load(page, site.url + READ_FIRST["ch01"])
    lines = page.evaluate(HANGING)
    assert len(lines) > 20, "expected Chapter 1's indented code lines"
    for line in lines:
        start = line["lead"] * line["ch"]  # where the line's own text starts
        if not (line["pad"] > start + 2 * line["ch"] and abs(line["indent"] + line["pad"]) < 1):
            problems.append(f"ch01: a wrapped code line would not go on under its start: {line}")
    for url, selector in (
        ("experiments/", ".experiments-table table"),
        ("appendix-b-repository-map/", "figure:has(.mermaid)"),
        ("appendix-b-repository-map/", ".repo-map table"),
        (READ_FIRST["ch01"], "figure:has(.mermaid)"),
    ):
        load(page, site.url + url)
        for box in page.evaluate(PAST_THE_EDGE, selector):
            if box["right"] > box["screen"] or box["wide"]:
                problems.append(f"{url}: {selector} is wider than a {PHONE}-px screen: {box}")
    assert not problems, "\n".join(problems)
    assert_clean(page)
    assert_clean(shown)


RUN_AND_RECORDED_FONT = """() => {
  const recorded = document.querySelector('details.output pre > code');
  const panel = document.querySelector('.run-panel:not(.run-local)');
  const run = document.createElement('pre');
  run.className = 'run-output';
  run.textContent = 'x';
  panel.append(run);
  const sizes = [recorded, run].map(e => getComputedStyle(e));
  const found = sizes.map(c => [c.fontSize, c.fontFamily]);
  run.remove();
  return found;
}"""


@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_run_output_reads_as_recorded_output(open_page, site, width: int) -> None:
    """A Run panel's output is shown in the font and size of the recorded output
    it is compared with, so the same columns fit (a bigger one cut them)."""
    page = open_page(width)
    load(page, site.url + READ_FIRST["ch01"])
    page.wait_for_selector(".run-panel:not(.run-local)")
    recorded, run = page.evaluate(RUN_AND_RECORDED_FONT)
    assert run == recorded
    assert_clean(page)


SHOTS = {  # what a reader sees first: the top, and the first of each kind of block
    "top": None,
    "excerpt": ".md-content .highlight:has(.filename)",
    "diagram": "figure.book-figure:has(.mermaid)",
    "plot": "figure.book-figure:has(img.plot)",
    "output": "details.output",
}


@pytest.mark.parametrize("scheme", ["light", "dark"])
@pytest.mark.parametrize("width", [PHONE, DESKTOP])
def test_screenshots(open_page, site, width: int, scheme: str) -> None:
    """Screens of the pages a reader opens first, for a person to look at."""
    page = open_page(width, scheme)
    ARTIFACTS.mkdir(exist_ok=True)
    taken = 0
    for name, path in READ_FIRST.items():
        load(page, site.url + path)
        page.evaluate("document.querySelectorAll('details.output').forEach(d => d.open = true)")
        for what, selector in SHOTS.items():
            if selector is None:
                page.evaluate("window.scrollTo(0, 0)")
            else:
                if not page.locator(selector).count():
                    continue
                # One scroll down to it, leaving room for the sticky header: scrolling
                # up would call up the theme's "back to top" button over the page.
                page.evaluate(
                    "s => window.scrollTo(0, document.querySelector(s)"
                    ".getBoundingClientRect().top + window.scrollY - 120)",
                    selector,
                )
            page.wait_for_timeout(150)
            page.screenshot(path=str(ARTIFACTS / f"site-{name}-{width}-{scheme}-{what}.png"))
            taken += 1
    assert taken >= 12
    assert_clean(page)


def record(what: str, values: list[str]) -> None:
    """Keep a measurement in test-artifacts/site-measurements.json for the reports."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / "site-measurements.json"
    found = json.loads(path.read_text()) if path.exists() else {}
    found[what] = values
    path.write_text(json.dumps(found, indent=2) + "\n")
