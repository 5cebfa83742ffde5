"""MkDocs hooks for the book: engine excerpts by name, results by name, and
the checks that keep a page from showing anything it did not get from a source.

- An excerpt directive line (see engine/tools/edition.py) becomes a titled code
  block whose line numbers are the source's own, and whose title links to the
  file at the edition's commit.
- A placeholder ``{{ result(...) }}`` or ``{{ engine(...) }}`` becomes the value
  a snippet recorded, or the constant the engine defines (engine/tools/results.py).
- A fenced code block may hold literal text only if it is a command or a diagram
  (bash, console, mermaid); any other fence must hold exactly one snippet include.
  Includes may name only the book's snippets, their outputs and results.

Every problem is a warning while serving, and fails `mkdocs build --strict` at
the end of the build, listing each one with its page and line.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mkdocs.exceptions import PluginError  # noqa: E402

from engine.tools.edition import (  # noqa: E402
    MANIFEST,
    ExcerptError,
    extract,
    parse_directive,
    strip_html_comments,
)
from engine.tools.results import substitute  # noqa: E402

log = logging.getLogger("mkdocs.hooks.book")
_problems: list[str] = []

FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
INCLUDE = re.compile(r'^[ \t]*--8<-- "(?P<path>[^"]+)"[ \t]*$')
# Fences whose body is written in the page: commands to type, and diagrams.
LITERAL_FENCES = {"bash", "sh", "console", "shell", "mermaid"}
SNIPPET_FILE = re.compile(r"^snippets/ch\d\d/(e\d\d_\w+|demo_\w+)\.(py|out|json)$")
# Files outside snippets/chNN/ that a page may include, and why.
INCLUDE_ALLOWLIST: dict[str, str] = {}


def on_pre_build(config) -> None:
    _problems.clear()


def on_config(config):
    manifest = ROOT / MANIFEST
    if manifest.is_file():
        config.extra["edition"] = json.loads(manifest.read_text())["edition"]
    return config


def _problem(page, line: int, message: str) -> None:
    where = f"docs/{page.file.src_uri}:{line}"
    _problems.append(f"{where}: {message}")
    log.warning("%s: %s", where, message)


def check_fences(markdown: str, report) -> None:
    """Report every fenced block that holds pasted text instead of an include,
    and every include of a file that is not one of the book's snippets."""
    lines = strip_html_comments(markdown).splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if (inc := INCLUDE.match(lines[i])) and parse_directive(lines[i]) is None:
                report(i + 1, f"include outside a code fence: {inc['path']}")
            i += 1
            continue
        start, closing = i, m["fence"]
        i += 1
        while i < len(lines) and lines[i].strip() != closing:
            i += 1
        body = [ln for ln in lines[start + 1 : i] if ln.strip()]
        language = (m["info"].split() or [""])[0].lstrip(".").lower()
        i += 1
        if language in LITERAL_FENCES:
            continue
        inc = INCLUDE.match(body[0]) if len(body) == 1 else None
        if inc is None:
            report(start + 1, f"a ```{language or 'plain'} block must hold one snippet include")
        elif not (SNIPPET_FILE.match(inc["path"]) or inc["path"] in INCLUDE_ALLOWLIST):
            report(start + 2, f"{inc['path']} is not a snippet, output or result file")
        elif not (ROOT / inc["path"]).is_file():
            report(start + 2, f"{inc['path']} does not exist")


def _source_url(config, file: str, start: int, end: int) -> str | None:
    repo = (config.repo_url or "").rstrip("/")
    commit = config.extra.get("edition", {}).get("commit", "")
    if not repo or not commit or commit == "unknown":
        return None
    return f"{repo}/blob/{commit}/{file}#L{start}-L{end}"


def _fence(indent: str, ex, title: str) -> list[str]:
    language = "cpp" if ex.file.endswith(".cpp") else "python"
    head = f'{indent}```{language} title="{title}" linenums="{ex.start}"'
    body = [f"{indent}{line}" if line else "" for line in ex.text.splitlines()]
    return [head, *body, f"{indent}```"]


def expand_excerpts(markdown: str, config, report, links: dict[str, str]) -> str:
    """Swap each directive for its code block; remember each title's source URL."""
    out: list[str] = []
    for number, line in enumerate(markdown.splitlines(), 1):
        parsed = parse_directive(line)
        if parsed is None:
            out.append(line)
            continue
        indent, file, name, kind = parsed
        try:
            ex = extract(ROOT, file, name, kind)
        except (ExcerptError, SyntaxError) as err:
            report(number, f"excerpt {line.strip()} not found: {err}")
            out += [
                f'{indent}!!! failure "Missing excerpt"',
                f"{indent}    `{line.strip()}`: {err}",
            ]
            continue
        title = f"{file} · {name}"
        out += _fence(indent, ex, title)
        if url := _source_url(config, file, ex.start, ex.end):
            links[title] = url
    return "\n".join(out) + "\n"


def on_page_markdown(markdown: str, page, config, files) -> str:
    def report(line: int, message: str) -> None:
        _problem(page, line, message)

    check_fences(markdown, report)
    markdown, errors = substitute(ROOT, page.file.src_uri, markdown)
    for error in errors:
        _problems.append(error)
        log.warning("%s", error)
    page.excerpt_links = {}
    return expand_excerpts(markdown, config, report, page.excerpt_links)


CODE_LINE = re.compile(r'<span id="__span-[\d-]+">(?P<body>.*?)(?=\n|<span id="__span-)', re.S)
TAGS = re.compile(r"<[^>]+>")
# A punctuation or operator token: a line that must wrap on a phone breaks after
# one (a <wbr>) rather than inside a name.
BREAK_AFTER = re.compile(r'(<span class="[op]">[^<]*</span>)(?!<wbr>)')


def mark_indents(html: str) -> str:
    """Give each code line that starts with spaces its indentation as ``--lead``,
    so that on a phone a line that wraps goes on under its own start, not the
    block's edge (book.css: the hanging indent); and let it break after its
    punctuation and operators rather than inside a name."""

    def mark(m: re.Match) -> str:
        line = BREAK_AFTER.sub(r"\1<wbr>", m[0])
        text = TAGS.sub("", m["body"])
        lead = len(text) - len(text.lstrip(" "))
        if lead == 0 or lead == len(text):
            return line
        return line.replace('">', f'" style="--lead:{lead}ch">', 1)

    return CODE_LINE.sub(mark, html)


def on_page_content(html: str, page, config, files) -> str:
    """Make each excerpt's title a link to its lines at the edition's commit, and
    mark each code line's indentation."""
    for title, url in getattr(page, "excerpt_links", {}).items():
        html = html.replace(
            f'<span class="filename">{title}</span>',
            f'<span class="filename"><a href="{url}">{title}</a></span>',
        )
    return mark_indents(html)


def on_post_build(config) -> None:
    # A warning alone does not stop `mkdocs build --strict -q`; an error does.
    if config.strict and _problems:
        raise PluginError("the book's pages have problems:\n" + "\n".join(_problems))
