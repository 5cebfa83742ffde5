"""MkDocs hooks for the book's reader-facing apparatus: numbered figures and tables,
links on every "Experiment N", and the generated list of experiments.

Figures and tables. Put a caption block after a plot, a Mermaid diagram or a table:

    ![Alt text that describes the plot](assets/plots/name.svg){ .plot }

    /// figure-caption
    What the figure shows, in a sentence. No result numbers: those live in outputs.
    ///

    | column | column |
    |---|---|
    | ... | ... |

    /// table-caption
    What the table lists.
    ///

`pymdownx.blocks.caption` wraps the figure or table and its caption in a <figure>;
this hook numbers them per chapter in page order, "Figure 2.3" being the third
figure of Chapter 2 (the Preface is P, appendices are A, B, ...), and gives each an
id to link to: [Figure 2.3](ch02-blocks-and-preemption.md#figure-2-3). A figure inside
a recorded output's fold answers a Predict box and is numbered apart, "Output 2.1"
(#output-2-1), so that the body's figures run without gaps. Every plot,
every diagram and every prose table gets one; tests/test_site_build.py checks it.

Experiment links. Write "Experiment 5" or "Experiments 5 and 6" in prose as plain
text: the build links each number to that experiment's heading ("## Experiment 5:
...") on its chapter's page, except inside headings, code and existing links. An
experiment that has a snippet but no heading fails `mkdocs build --strict`; one
that has neither (a chapter not written yet) stays plain text.

The experiments page, experiments.md, is generated from snippets/ at build time:
one row per snippets/chNN/eNN_slug.py, with its title from the first line of its
docstring, what it imports beyond the standard library, a link to its listing on
its chapter's page (where the Run button is: each listing gets the anchor
run_anchor(N) here), and a link to its chapter's notebook (docs/hooks/notebooks.py).

Appendix B's map of the repository is generated too, by engine/tools/repo_map.py,
in place of the marker line its page holds.
"""

from __future__ import annotations

import ast
import importlib.util
import logging
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File
from mkdocs.utils import get_relative_url

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS_PAGE = "experiments.md"
MAP_PAGE, MAP_MARKER = "appendix-b-repository-map.md", "<!-- the map, generated -->"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

log = logging.getLogger("mkdocs.hooks.site")
_errors: list[str] = []


def _load_runner():
    """snippets/_runner.py is a script, not a package; load it by path (as the tests do)."""
    spec = importlib.util.spec_from_file_location(
        "snippet_runner", ROOT / "snippets" / "_runner.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- The experiments, from snippets/ -------------------------------------------------


@dataclass(frozen=True)
class Experiment:
    number: int
    chapter: int
    path: str  # snippets/chNN/eNN_slug.py
    title: str  # the docstring's first line, without "Experiment N:"
    needs: tuple[str, ...]  # what it imports beyond the standard library


def _needs(tree: ast.Module, folder: Path) -> tuple[str, ...]:
    """Top-level modules imported that are neither the standard library nor a helper
    module beside the snippets (snippets/*.py, snippets/chNN/*.py)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    local = {p.stem for d in (folder, folder.parent) for p in d.glob("*.py")} | {"snippets"}
    return tuple(sorted(n for n in names if n not in sys.stdlib_module_names | local))


def discover_experiments() -> list[Experiment]:
    runner = _load_runner()
    found = []
    for rel in runner.discover():
        m = runner.EXPERIMENT.match(rel)
        if not m:
            continue  # an engine demo
        path = ROOT / rel
        tree = ast.parse(path.read_text(), filename=rel)
        first = (ast.get_docstring(tree) or "").strip().splitlines() or [""]
        title = re.sub(r"^Experiment \d+:\s*", "", first[0]).rstrip(".")
        title = title[:1].upper() + title[1:]
        found.append(
            Experiment(int(m["number"]), int(m["chapter"]), rel, title, _needs(tree, path.parent))
        )
    return sorted(found, key=lambda e: e.number)


def run_anchor(number: int) -> str:
    """The id of the place on its chapter's page where Experiment ``number``'s listing,
    and the Run button under it, begin."""
    return f"run-experiment-{number}"


def notebook_uri(page: str) -> str:
    """Where the site serves the notebook of the chapter page ``page`` ("ch07-x.md")."""
    return f"notebooks/{Path(page).stem}.ipynb"


LISTING = re.compile(r'^\?\?\? listing "[^"]*"\n    ```python title="(?P<path>[^"]+)"', re.M)


def mark_listings(markdown: str) -> str:
    """Put run_anchor(N) just before each experiment's listing: an empty element, so the
    page looks the same, and raw HTML, so MkDocs knows the anchor when it checks links."""

    def mark(m: re.Match) -> str:
        number = re.match(r"snippets/ch\d\d/e(\d\d)_", m["path"])
        if number is None:
            return m[0]  # an engine demo
        return f'<div id="{run_anchor(int(number[1]))}"></div>\n\n{m[0]}'

    return LISTING.sub(mark, markdown)


def _chapter_pages(docs: Path) -> dict[int, Path]:
    return {int(p.name[2:4]): p for p in docs.glob("ch[0-9][0-9]-*.md")}


def _h1(page: Path) -> str:
    for line in page.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return page.stem


# Icons, so that the chapter and command cells, which stay on one line (book.css), stay short.
RUN_ICON, NOTEBOOK_ICON = ":material-play-circle-outline:", ":material-notebook-outline:"


def _row(e: Experiment, page: Path | None, with_needs: bool) -> str:
    needs = f" {', '.join(f'`{n}`' for n in e.needs) or 'standard library'} |" * with_needs
    command = f"`python {e.path}`"
    if page is None:
        return f"| Experiment {e.number} | Chapter {e.chapter} | {e.title} |{needs} {command} |"
    # Short, so the table fits a desktop column; the chapter's title shows on hover.
    chapter = f'[Chapter {e.chapter}]({page.name} "{_h1(page)}")'
    notebook = notebook_uri(page.name)
    chapter += (
        f' [{NOTEBOOK_ICON}]({notebook} "Chapter {e.chapter} as a notebook")'
        f'{{ download="{Path(notebook).name}" }}'
    )
    where = "Run it in the page" if not e.needs else "Its listing, and what it needs"
    run = f'[{RUN_ICON}]({page.name}#{run_anchor(e.number)} "{where}")'
    return f"| Experiment {e.number} | {chapter} | {e.title} |{needs} {run} {command} |"


def experiments_markdown(experiments: list[Experiment], docs: Path) -> str:
    chapters = _chapter_pages(docs)
    # A column that would say the same in every row is a sentence instead.
    with_needs = any(e.needs for e in experiments)
    rows = [_row(e, chapters.get(e.chapter), with_needs) for e in experiments]
    with_notebooks = sorted({e.chapter for e in experiments} & set(chapters))
    notebooks = [
        f"- [{_h1(chapters[c])}]({notebook_uri(chapters[c].name)})"
        f'{{ download="{Path(notebook_uri(chapters[c].name)).name}" }}'
        for c in with_notebooks
    ]
    return "\n".join(
        [
            "# Experiments",
            "",
            "Every numbered experiment in the book, listed from `snippets/` when the site is",
            "built."
            + ("" if with_needs else " Each runs on Python's standard library alone.")
            + " Run one from the repository's root with the Python you already have; it",
            "prints exactly the output the book records beside it (`.out`). Or run it where",
            f"the book shows it: {RUN_ICON} goes to its listing on its chapter's page, where",
            "the Run button runs a standard-library experiment in your browser. Each",
            f"chapter's experiments are also a Jupyter notebook ({NOTEBOOK_ICON}), each file",
            "unchanged with its recorded output.",
            "",
            '<div class="experiments-table" markdown>',
            "",
            "| Experiment | Chapter | What it measures |" + " Needs |" * with_needs + " Run it |",
            "|---|---|---|" + "---|" * with_needs + "---|",
            *rows,
            "",
            "</div>",
            "",
            "/// table-caption",
            "Every experiment, the chapter it belongs to,"
            + " what it needs," * with_needs
            + " and how to run it.",
            "///",
            "",
            "The notebooks, one per chapter:",
            "",
            *notebooks,
            "",
        ]
    )


# --- Hooks -----------------------------------------------------------------------------

_experiments: list[Experiment] = []
_anchors: dict[int, tuple[str, str]] = {}  # experiment number -> (page url, heading id)


def on_pre_build(config) -> None:
    _errors.clear()
    _anchors.clear()


def on_files(files, config):
    _experiments[:] = discover_experiments()
    docs = Path(config["docs_dir"])
    content = experiments_markdown(_experiments, docs)
    files.append(File.generated(config, EXPERIMENTS_PAGE, content=content))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    if re.match(r"ch\d\d-", page.file.src_uri):
        return mark_listings(markdown)
    if page.file.src_uri != MAP_PAGE:
        return markdown
    from engine.tools.repo_map import markdown as repo_map  # reads the source; no torch

    if MAP_MARKER not in markdown:
        raise PluginError(f"{MAP_PAGE} has lost its marker line {MAP_MARKER!r}")
    return markdown.replace(MAP_MARKER, repo_map(ROOT))


def _label(page) -> str | None:
    """The chapter's label in figure numbers: 1, 2, ... for chapters, P for the
    Preface, 0 for the architecture page that comes before Chapter 1, A, B, ... for
    appendices; None for pages outside the book's order."""
    name = page.file.src_uri
    if name == "index.md":
        return "P"
    if name == "architecture.md":
        return "0"
    if m := re.match(r"ch(\d\d)-", name):
        return str(int(m[1]))
    if m := re.match(r"appendix-([a-z])-", name):
        return m[1].upper()
    return None


FIGURE = re.compile(r'<figure id="__(?P<kind>figure|table)-caption_[\d_]+"')
PREFIX = re.compile(r'<span class="caption-prefix">(?:Figure|Table) [\d.]+\.?</span>')


def in_folded_output(html: str, pos: int) -> bool:
    """Whether ``pos`` lies inside a recorded output's fold (``??? output``)."""
    start = html.rfind('<details class="output"', 0, pos)
    return start >= 0 and html.find("</details>", start, pos) < 0


def number_figures(html: str, label: str | None, where: str) -> str:
    """Renumber the caption extension's per-page "Figure 3." as "Figure 2.3". A
    figure inside a recorded output's fold answers a Predict box: it is "Output
    2.1", in a sequence of its own, so that the body's figures, which a reader
    sees without unfolding anything, are numbered without gaps."""
    out, pos, counts = [], 0, {"figure": 0, "table": 0, "output": 0}
    for m in FIGURE.finditer(html):
        kind = "output" if in_folded_output(html, m.start()) else m["kind"]
        counts[kind] += 1
        number = f"{label}.{counts[kind]}" if label else str(counts[kind])
        prefix = PREFIX.search(html, m.end())
        if prefix is None:
            _errors.append(f"{where}: a {kind} caption has no number")
            continue
        out.append(html[pos : m.start()])
        style = "book-figure book-output" if kind == "output" else f"book-{kind}"
        out.append(f'<figure id="{kind}-{number.lower().replace(".", "-")}" class="{style}"')
        out.append(html[m.end() : prefix.start()])
        out.append(f'<span class="caption-prefix">{kind.title()} {number}.</span>')
        pos = prefix.end()
    out.append(html[pos:])
    return "".join(out)


def _headings(toc) -> list:
    for item in toc:
        yield item
        yield from _headings(item.children)


def on_page_content(html: str, page, config, files) -> str:
    html = number_figures(html, _label(page), page.file.src_uri)
    for item in _headings(page.toc):
        m = re.match(r"Experiment (\d+)\b", item.title)
        if m:
            number = int(m[1])
            if number in _anchors:
                _errors.append(f"{page.file.src_uri}: a second heading for Experiment {number}")
            _anchors[number] = (page.url, item.id)
    _keep_for_print(page, html)
    return html


# Elements whose text is never linked: links themselves, code, headings and scripts.
SKIP = {"a", "code", "pre", "kbd", "script", "style", "svg", "title", "textarea"}
SKIP |= {f"h{i}" for i in range(1, 7)}
TAG = re.compile(r"<!--.*?-->|<(/?)([a-zA-Z][a-zA-Z0-9]*)\b[^>]*?(/?)>", re.S)
MENTION = re.compile(
    r"\b(?:Experiment(?:&nbsp;|\s)+(?P<one>\d+)"
    r"|Experiments(?:&nbsp;|\s)+(?P<first>\d+)(?P<more>(?:(?:,\s*|\s*(?:–|&ndash;|-)\s*"
    r"|,?\s+(?:and|or|to)\s+)\d+)*))\b"
)


def link_experiments(html: str, page_url: str, where: str) -> str:
    def href(number: int) -> str | None:
        if number not in _anchors:
            if any(e.number == number for e in _experiments):
                _errors.append(f"{where}: Experiment {number} has a snippet but no heading")
            return None  # not written yet: left as plain text
        url, anchor = _anchors[number]
        if url == page_url:
            return f"#{anchor}"
        return f"{get_relative_url(url, page_url)}#{anchor}"

    def link(text: str, number: int) -> str:
        target = href(number)
        return f'<a class="experiment-link" href="{target}">{text}</a>' if target else text

    def replace(m: re.Match) -> str:
        if m["one"]:
            return link(m[0], int(m["one"]))
        head = m[0][: m.end("first") - m.start()]
        more = re.sub(r"\d+", lambda n: link(n[0], int(n[0])), m["more"])
        return link(head, int(m["first"])) + more

    out, pos, skipping = [], 0, []
    for tag in TAG.finditer(html):
        text = html[pos : tag.start()]
        out.append(text if skipping else MENTION.sub(replace, text))
        out.append(tag[0])
        pos = tag.end()
        name = (tag[2] or "").lower()
        if name in SKIP and not tag[3]:
            if tag[1]:
                if name in skipping:
                    del skipping[len(skipping) - 1 - skipping[::-1].index(name)]
            else:
                skipping.append(name)
    tail = html[pos:]
    out.append(tail if skipping else MENTION.sub(replace, tail))
    return "".join(out)


def on_page_context(context, page, config, nav):
    # Every page's headings are known by now: MkDocs renders all pages' content
    # before it builds any page's context.
    page.content = link_experiments(page.content, page.url, page.file.src_uri)
    _keep_for_print(page, page.content)
    if page.file.src_uri == EXPERIMENTS_PAGE:
        page.edit_url = None  # generated: there is no file to edit
    return context


def _keep_for_print(page, html: str) -> None:
    # The print-site plugin (`make pdf`) keeps each page's HTML from before this
    # hook ran; give it the numbered, linked version.
    if hasattr(page, "html"):
        page.html = html


def on_post_build(config) -> None:
    if _errors:
        errors = list(dict.fromkeys(_errors))  # each once, in the order found
        message = "the book's figures or experiment links are broken:\n" + "\n".join(errors)
        if config.strict:
            raise PluginError(message)
        log.warning(message)
