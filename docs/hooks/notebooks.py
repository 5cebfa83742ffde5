"""MkDocs hook: one Jupyter notebook per chapter that has experiments, built from
the same sources as the chapter's page, so that a notebook cannot drift from it.

For each experiment (snippets/chNN/eNN_slug.py), in the page's order:
- a markdown cell with the experiment's heading, its setup (the prose between the
  heading and the Predict box) and its Predict box, taken from the page after every
  ``{{ result(...) }}`` has been substituted as the page substitutes it;
- a code cell holding the experiment's file, unchanged, with the recorded .out as
  its output: before a reader runs it, the cell shows what the book shows, and a run
  that prints anything else has drifted (tests/test_notebooks.py runs every one).
The chapter's engine demos follow, each with its recorded output and the command that
runs it from a clone, since they need the engine's install.

Each notebook is served for download at notebooks/chNN-slug.ipynb, and its chapter page
gets a line that links it; the experiments page links it from every row
(docs/hooks/site.py). It is not rendered as a page of its own with mkdocs-jupyter: each
such page carries hundreds of kilobytes of JupyterLab's CSS, made for a light theme only,
and its Markdown renderer drops the backslashes of the book's \\( \\) math; the chapter's
page already shows every cell.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import nbformat
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output


def _load(name: str, module: str):
    """A sibling hook, loaded by path (hooks are not a package)."""
    spec = importlib.util.spec_from_file_location(module, Path(__file__).with_name(name))
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded  # for its dataclasses
    spec.loader.exec_module(loaded)
    return loaded


_run_in_page = _load("run_in_page.py", "book_run_in_page")
_site = _run_in_page._site
ROOT = _site.ROOT
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from engine.tools.edition import strip_html_comments  # noqa: E402
from engine.tools.results import substitute  # noqa: E402

# The cell tag nbclient (and papermill) skip: the demos need the engine's install.
SKIP = "skip-execution"
HEADING = re.compile(r"^(?P<level>#{2,6}) (?P<title>Experiment (?P<number>\d+)\b.*)$")
ADMONITION = re.compile(r'^(?:!!!|\?\?\?\+?) (?P<kind>[\w-]+)(?: "(?P<title>[^"]*)")?\s*$')
FENCE = re.compile(r"^(`{3,}|~{3,})")
CAPTION = re.compile(r"^/// (?P<kind>figure|table)-caption\s*$")
LINK = re.compile(r'(?P<head>!?\[[^\]]*\]\()(?P<url>[^)\s]+)(?P<tail>(?:\s+"[^"]*")?\))')
# The page's math delimiters (arithmatex's) and Jupyter's: \( \) and \[ \] become $ and $$.
MATH = re.compile(r"(?<!\\)\\([()\[\]])")


@dataclass(frozen=True)
class Chapter:
    number: int
    page: str  # "ch07-correctness.md"
    title: str  # the page's own heading, "7. Correctness guarantees"
    experiments: tuple[str, ...]  # snippets/chNN/eNN_slug.py, by number
    demos: tuple[str, ...]  # snippets/chNN/demo_slug.py, in the page's order

    @property
    def notebook(self) -> str:
        """Where the site serves it, relative to the site's root."""
        return _site.notebook_uri(self.page)


def chapters(root: Path = ROOT) -> list[Chapter]:
    """Every chapter page that has experiments, with its experiments and demos."""
    docs = root / "docs"
    pages = _site._chapter_pages(docs)
    runner = _site._load_runner()
    every = _site.discover_experiments()
    found = []
    for number, page in sorted(pages.items()):
        experiments = tuple(e.path for e in every if e.chapter == number)
        if not experiments:
            continue
        text = page.read_text()
        demos = [p for p in runner.discover() if p.startswith(f"snippets/ch{number:02d}/demo_")]
        demos.sort(key=lambda p: (p not in text, text.find(p), p))
        found.append(Chapter(number, page.name, _site._h1(page), experiments, tuple(demos)))
    return found


# --- The page's text, as a notebook's markdown ---------------------------------------


def _absolute(url: str, page_url: str, site_url: str) -> str:
    """A link of the page, as a notebook opened anywhere can follow it."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", url):
        return url  # https:, mailto:
    if url.startswith("#"):
        return page_url + url
    path, _, fragment = url.partition("#")
    if path.endswith(".md"):
        stem = path[: -len(".md")]
        path = "" if stem == "index" else f"{stem}/"
    return site_url + path + (f"#{fragment}" if fragment else "")


def _block_end(lines: list[str], start: int) -> int:
    """The end of an indented block (an admonition's body) that starts at ``start``."""
    end = start
    while end < len(lines) and (not lines[end].strip() or lines[end].startswith("    ")):
        end += 1
    while end > start and not lines[end - 1].strip():
        end -= 1
    return end


def _caption_line(kind: str, number: str, caption: list[str], page_url: str) -> str:
    text = " ".join(line.strip() for line in caption)
    label = f"{kind.title()} {number}"
    return f"*[{label}]({page_url}#{kind}-{number.replace('.', '-')}), on the page: {text}*"


def to_notebook_markdown(lines: list[str], first: int, ctx: dict) -> list[str]:
    """The page's lines [first, first + len(lines)) as plain Markdown a notebook renders:
    an admonition becomes a quote under its title, a diagram or plot becomes a link to
    it on the page (its caption says what it shows), excerpts and other code blocks are
    left out (the code cell holds the whole file), and every link is made absolute."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if FENCE.match(line):  # a diagram or a code block: the page shows it
            close = FENCE.match(line)[1]
            i += 1
            while i < len(lines) and lines[i].strip() != close:
                i += 1
        elif m := CAPTION.match(line):
            end = lines.index("///", i + 1)
            kind, number = ctx["captions"][first + i]
            out.append(_caption_line(kind, number, lines[i + 1 : end], ctx["page_url"]))
            i = end
        elif m := ADMONITION.match(line):
            end = _block_end(lines, i + 1)
            body = textwrap.dedent("\n".join(lines[i + 1 : end])).splitlines()
            quoted = [f"**{m['title'] or m['kind'].title()}**", ""]
            quoted += to_notebook_markdown(body, first + i + 1, ctx)
            out += [f"> {q}".rstrip() for q in quoted]
            i = end - 1
        elif not line.startswith(("--8<--", "![")):
            out.append(_jupyter_math(LINK.sub(lambda m: _link(m, ctx), line)))
        i += 1
    return _squeeze(out)


def _link(m: re.Match, ctx: dict) -> str:
    return m["head"] + _absolute(m["url"], ctx["page_url"], ctx["site_url"]) + m["tail"]


def _jupyter_math(line: str) -> str:
    """Jupyter typesets $...$ and $$...$$ only; a literal $ is escaped first."""
    line = line.replace("$", "\\$")
    return MATH.sub(lambda m: "$" if m[1] in "()" else "$$", line)


def _squeeze(lines: list[str]) -> list[str]:
    """No leading, trailing or repeated blank lines."""
    out: list[str] = []
    for line in lines:
        if line.strip() or (out and out[-1].strip()):
            out.append(line)
    while out and not out[-1].strip():
        out.pop()
    return out


def _caption_numbers(lines: list[str], chapter: int) -> dict[int, tuple[str, str]]:
    """Line index -> ("figure", "7.2"): figures and tables are numbered per chapter in
    page order, those inside a recorded output's fold apart as "output", as
    docs/hooks/site.py numbers them."""
    counts = {"figure": 0, "table": 0, "output": 0}
    numbers, folded = {}, False
    for i, line in enumerate(lines):
        if line.startswith("??? output"):
            folded = True
        elif line.strip() and not line.startswith("    "):
            folded = False
        if m := CAPTION.match(line.strip()):
            kind = "output" if folded else m["kind"]
            counts[kind] += 1
            numbers[i] = (kind, f"{chapter}.{counts[kind]}")
    return numbers


# --- The notebook ----------------------------------------------------------------------


def experiment_markdown(lines: list[str], number: int, ctx: dict) -> str:
    """Experiment ``number``'s heading, setup and Predict box, from the page's lines."""
    start = next((i for i, ln in enumerate(lines) if (m := HEADING.match(ln)) and
                  int(m["number"]) == number), None)  # fmt: skip
    if start is None:
        raise PluginError(f"{ctx['page']}: Experiment {number} has no heading")
    level = len(HEADING.match(lines[start])["level"])
    predict = next(
        (i for i in range(start + 1, len(lines)) if lines[i].startswith("!!! predict")), None
    )
    after = next(
        (i for i in range(start + 1, len(lines)) if re.match(rf"^#{{1,{level}}} ", lines[i])),
        len(lines),
    )
    if predict is None or predict > after:
        raise PluginError(f"{ctx['page']}: Experiment {number} has no Predict box")
    end = _block_end(lines, predict + 1)
    text = to_notebook_markdown(lines[start + 1 : end], start + 1, ctx)
    return "\n".join([f"## {HEADING.match(lines[start])['title']}", "", *text])


# A code cell's recorded output starts folded, as the page folds it under its Predict
# box: JupyterLab and Notebook 7 read jupyter.outputs_hidden, classic Notebook collapsed.
FOLDED = {"jupyter": {"outputs_hidden": True}, "collapsed": True}


def _code_cell(rel: str, cell_id: str, root: Path, tags: list[str]) -> nbformat.NotebookNode:
    out = (root / rel).with_suffix(".out").read_text()
    metadata = {"snippet": rel, **FOLDED, **({"tags": tags} if tags else {})}
    cell = new_code_cell(
        (root / rel).read_text(),
        outputs=[new_output("stream", name="stdout", text=out)],
        metadata=metadata,
    )
    cell["id"] = cell_id
    return cell


def _markdown_cell(text: str, cell_id: str) -> nbformat.NotebookNode:
    cell = new_markdown_cell(text)
    cell["id"] = cell_id
    return cell


def _intro(chapter: Chapter, ctx: dict) -> str:
    return "\n".join(
        [
            f"# {chapter.title}: the experiments",
            "",
            f"The experiments of [this chapter]({ctx['page_url']}) of *Inside DeepInfer*, made"
            " from the book's sources when its site was built. Each code cell is an"
            " experiment's file, unchanged, and the output under it, folded until you"
            " unfold it, is the one the book records: answer the Predict box first, then"
            " run the cell, and it prints the same. The experiments need only Python's"
            " standard library, unless a cell says otherwise.",
        ]
    )


def notebook(chapter: Chapter, site_url: str, root: Path = ROOT) -> nbformat.NotebookNode:
    """The chapter's notebook; its links point into the site at ``site_url``."""
    page = f"docs/{chapter.page}"
    markdown, errors = substitute(root, chapter.page, (root / page).read_text())
    if errors:
        raise PluginError("\n".join(errors))
    lines = strip_html_comments(markdown).splitlines()
    site_url = site_url.rstrip("/") + "/"
    ctx = {
        "page": page,
        "site_url": site_url,
        "page_url": f"{site_url}{Path(chapter.page).stem}/",
        "captions": _caption_numbers(lines, chapter.number),
    }
    entries = _run_in_page.entries()
    cells = [_markdown_cell(_intro(chapter, ctx), "intro")]
    for rel in chapter.experiments:
        stem, number = Path(rel).stem, int(Path(rel).stem[1:3])
        text = experiment_markdown(lines, number, ctx)
        entry = entries[rel]
        there = f"[the chapter's page]({ctx['page_url']}#{_site.run_anchor(number)})"
        if entry["runs_here"]:
            text += f"\n\nOn {there}, a Run button runs it in the browser too."
        else:
            text += f"\n\n{entry['why']} Run it from a clone's root: `{entry['command']}`"
        cells.append(_markdown_cell(text, f"{stem}-text"))
        cells.append(_code_cell(rel, stem, root, [] if entry["runs_here"] else [SKIP]))
    cells += _demo_cells(chapter, entries, root)
    return new_notebook(
        cells=cells,
        metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
            "language_info": {"name": "python"},
        },
    )


def _demo_cells(chapter: Chapter, entries: dict, root: Path) -> list[nbformat.NotebookNode]:
    if not chapter.demos:
        return []
    cells = [
        _markdown_cell(
            "## Run it on the engine\n\nThe chapter's demos drive DeepInfer itself, so they"
            " need a clone of the repository and the engine's install: from its root,"
            " `make test` sets up `.venv` with PyTorch and the engine. Each runs there with"
            " the command above it; here, its cell shows the output the book records.",
            "demos",
        )
    ]
    for rel in chapter.demos:
        stem = Path(rel).stem
        doc = (ast.get_docstring(ast.parse((root / rel).read_text())) or "").split("\n")[0]
        text = (
            f"### `{rel}`\n\n{doc}\n\nNeeds a checkout's engine: it does not run in this"
            f" notebook. From the root of a clone, with the engine installed, run"
            f" `{entries[rel]['command']}`; the cell shows the output the book records."
        )
        cells.append(_markdown_cell(text, f"{stem}-text"))
        cells.append(_code_cell(rel, stem, root, [SKIP]))
    return cells


def notebook_text(chapter: Chapter, site_url: str, root: Path = ROOT) -> str:
    """The .ipynb file's text, validated against the notebook format's schema."""
    nb = notebook(chapter, site_url, root)
    nbformat.validate(nb)
    return nbformat.writes(nb)


# --- Hooks -----------------------------------------------------------------------------


_chapters: list[Chapter] = []


def on_files(files, config):
    _chapters[:] = chapters()
    for chapter in _chapters:
        text = notebook_text(chapter, config.site_url or "/")
        files.append(File.generated(config, chapter.notebook, content=text))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A line near the top of each chapter page that has a notebook: before its first
    section, after the chapter's introduction."""
    chapter = next((c for c in _chapters if c.page == page.file.src_uri), None)
    if chapter is None:
        return markdown
    name = Path(chapter.notebook).name
    line = (
        ":material-notebook-outline: This chapter's experiments are also a Jupyter notebook,"
        " each file unchanged with the output the book records:"
        f' [{name}]({chapter.notebook}){{ download="{name}" }}.'
    )
    lines = markdown.splitlines()
    first = next((i for i, ln in enumerate(lines) if ln.startswith("## ")), len(lines))
    return "\n".join([*lines[:first], line, "", *lines[first:]]) + "\n"


if __name__ == "__main__":  # one chapter's notebook: python docs/hooks/notebooks.py 7
    wanted = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    for c in chapters():
        if c.number == wanted:
            print(notebook_text(c, "http://127.0.0.1:8000/"))
