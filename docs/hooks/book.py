"""MkDocs hooks for the book: engine excerpts by name, and the edition footer.

Pages quote the engine with a directive line (see engine/tools/edition.py). This hook
swaps each one for a titled code block whose line numbers are the source's own.
A name the engine does not define is a warning while serving, and fails
`mkdocs build --strict` at the end of the build, listing every missing one.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mkdocs.exceptions import PluginError  # noqa: E402

from engine.tools.edition import MANIFEST, ExcerptError, extract, parse_directive  # noqa: E402

log = logging.getLogger("mkdocs.hooks.book")
_missing: list[str] = []


def on_pre_build(config) -> None:
    _missing.clear()


def on_config(config):
    manifest = ROOT / MANIFEST
    if manifest.is_file():
        config.extra["edition"] = json.loads(manifest.read_text())["edition"]
    return config


def _fence(indent: str, ex, title: str) -> list[str]:
    head = f'{indent}```python title="{title}" linenums="{ex.start}"'
    body = [f"{indent}{line}" if line else "" for line in ex.text.splitlines()]
    return [head, *body, f"{indent}```"]


def on_page_markdown(markdown: str, page, config, files) -> str:
    out: list[str] = []
    for line in markdown.splitlines():
        parsed = parse_directive(line)
        if parsed is None:
            out.append(line)
            continue
        indent, file, name, kind = parsed
        try:
            ex = extract(ROOT, file, name, kind)
        except (ExcerptError, SyntaxError) as err:
            _missing.append(f"{page.file.src_uri}: {line.strip()}: {err}")
            log.warning("%s: excerpt %s not found: %s", page.file.src_uri, line.strip(), err)
            out += [
                f'{indent}!!! failure "Missing excerpt"',
                f"{indent}    `{line.strip()}`: {err}",
            ]
            continue
        out += _fence(indent, ex, f"{file} · {name}")
    return "\n".join(out) + "\n"


def on_post_build(config) -> None:
    # A warning alone does not stop `mkdocs build --strict -q`; an error does.
    if config.strict and _missing:
        raise PluginError("pages name excerpts the engine does not define:\n" + "\n".join(_missing))
