"""Results in prose: a page names a recorded value, and the build writes it in.

Every snippet's ``main()`` returns its results as a dict of named values, and
``make regen`` records them beside its output: ``snippets/ch02/demo_x.out``
gets ``snippets/ch02/demo_x.json``. A page never types such a number. It
names it, and the book's build hook substitutes it:

    {{ result("ch02/demo_prefix_cache", "hit_tokens") }}       112
    {{ result("ch02/e05_fragmentation", "waste", ".1%") }}      50.1%
    {{ engine("engine/config/engine.py::EngineConfig.block_size") }}   16

The optional last argument is a Python format spec (``","``, ``".1%"``,
``".3f"``...). ``engine(...)`` reads a constant straight from the engine's
source, with the qualified-name lookup that excerpts use, so a default the
prose quotes cannot drift from the code either. An unknown snippet, name or
constant is an error that names the page and the line.

Standard library only: the site builds without torch.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from engine.tools.edition import ExcerptError, find_qualname

PLACEHOLDER = re.compile(r"\{\{\s*(?P<call>[a-z]+\(.*?\))\s*\}\}")
VALUE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
SNIPPET_NAME = re.compile(r"^ch\d\d/(e\d\d_\w+|demo_\w+)$")
Value = bool | int | float | str | list


class ResultError(LookupError):
    """A page names a result or constant that does not exist, or misformats one."""


@dataclass(frozen=True)
class Binding:
    """One placeholder on one page: what it names, and where it stands."""

    page: str  # docs-relative path, e.g. "ch02-blocks-and-preemption.md"
    line: int  # 1-based line of the page's Markdown source
    kind: str  # "result" or "engine"
    source: str  # "ch02/demo_x" for a result, "engine/x.py::NAME" for a constant
    name: str  # the value's name ("" for a constant)
    spec: str  # the format spec, "" for the default

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def sidecar_path(root: Path, snippet: str) -> Path:
    return root / "snippets" / f"{snippet}.json"


def parse(call: str) -> tuple[str, list[str]]:
    """``result("a", "b")`` -> ("result", ["a", "b"]): string literals only."""
    try:
        node = ast.parse(call, mode="eval").body
    except SyntaxError as err:
        raise ResultError(f"cannot parse {call!r}: {err.msg}") from None
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.keywords:
        raise ResultError(f"{call!r} is not result(...) or engine(...)")
    args = []
    for arg in node.args:
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            raise ResultError(f"{call!r}: every argument must be a string literal")
        args.append(arg.value)
    return node.func.id, args


def binding(page: str, line: int, call: str) -> Binding:
    kind, args = parse(call)
    if kind == "result" and len(args) in (2, 3):
        snippet, name, spec = (*args, "")[:3]
        if not SNIPPET_NAME.match(snippet):
            raise ResultError(f"{snippet!r} is not a snippet name like 'ch02/demo_prefix_cache'")
        return Binding(page, line, kind, snippet, name, spec)
    if kind == "engine" and len(args) in (1, 2):
        ref, spec = (*args, "")[:2]
        return Binding(page, line, kind, ref, "", spec)
    raise ResultError(
        f"{call!r}: write result(SNIPPET, NAME[, SPEC]) or engine(FILE::NAME[, SPEC])"
    )


def bindings(page: str, markdown: str) -> list[Binding]:
    """Every placeholder of a page, in order; a malformed one raises ResultError."""
    found = []
    for number, text in enumerate(markdown.splitlines(), 1):
        for m in PLACEHOLDER.finditer(text):
            try:
                found.append(binding(page, number, m["call"]))
            except ResultError as err:
                raise ResultError(f"docs/{page}:{number}: {err}") from None
    return found


@cache
def _sidecar(path: Path, mtime: float) -> dict[str, Value]:
    return json.loads(path.read_text())


def load_results(root: Path, snippet: str) -> dict[str, Value]:
    path = sidecar_path(root, snippet)
    if not path.is_file():
        raise ResultError(f"snippet {snippet!r} has no recorded results ({path.name} is missing)")
    return _sidecar(path, path.stat().st_mtime)


def engine_constant(root: Path, ref: str) -> Value:
    """A literal the engine's source assigns, found by qualified name:
    ``engine/config/engine.py::EngineConfig.block_size`` reads the field's default."""
    file, sep, qualname = ref.partition("::")
    path = root / file
    if not sep or not file.startswith("engine/") or not path.is_file():
        raise ResultError(f"{ref!r} names no engine file (write engine/FILE.py::NAME)")
    node = find_qualname(ast.parse(path.read_text(), filename=file), qualname)
    value = getattr(node, "value", None) if isinstance(node, ast.Assign | ast.AnnAssign) else None
    if value is None:
        raise ExcerptError(f"{file} assigns no constant {qualname!r}")
    try:
        return ast.literal_eval(value)
    except ValueError:
        raise ResultError(f"{ref} is not a literal constant") from None


def lookup(root: Path, b: Binding) -> Value:
    if b.kind == "engine":
        return engine_constant(root, b.source)
    results = load_results(root, b.source)
    if b.name not in results:
        known = ", ".join(sorted(results)) or "none"
        raise ResultError(f"{b.source} recorded no value {b.name!r} (it records: {known})")
    return results[b.name]


def format_value(value: Value, spec: str) -> str:
    """A value as the page asks: a format spec applies to each item of a list."""
    if isinstance(value, list):
        if not value:
            raise ResultError("an empty list shows as nothing")
        return ", ".join(format_value(v, spec) for v in value)
    if isinstance(value, float) and not spec:
        raise ResultError(f"{value!r} is a float: give a format spec such as '.2f' or '.1%'")
    try:
        shown = format(value, spec)
    except (ValueError, TypeError) as err:
        raise ResultError(f"cannot format {value!r} with {spec!r}: {err}") from None
    if not shown.strip():
        raise ResultError(f"{value!r} shows as nothing")
    return shown


def _not_a_list_marker(shown: str, before: str, after: str) -> str:
    """A number that starts a line, followed by "." or ")" and a space, would make
    Markdown begin a numbered list there ("255. On paper" becomes item 255): escape it."""
    if not before.strip() and re.fullmatch(r"[\d,]+", shown) and re.match(r"[.)](\s|$)", after):
        return shown + "\\"
    return shown


def substitute(root: Path, page: str, markdown: str) -> tuple[str, list[str]]:
    """The page with every placeholder replaced, and the errors, each naming
    the page and line (a placeholder that fails is left as it was)."""
    errors: list[str] = []
    lines = markdown.splitlines(keepends=True)
    for i, text in enumerate(lines):

        def one(m: re.Match, number: int = i + 1, line: str = text) -> str:
            try:
                b = binding(page, number, m["call"])
                shown = format_value(lookup(root, b), b.spec)
            except (ResultError, ExcerptError, SyntaxError) as err:
                errors.append(f"docs/{page}:{number}: {m[0]}: {err}")
                return m[0]
            return _not_a_list_marker(shown, line[: m.start()], line[m.end() :])

        lines[i] = PLACEHOLDER.sub(one, text)
    return "".join(lines), errors


def all_bindings(root: Path) -> list[Binding]:
    """Every placeholder on every page of the book."""
    found = []
    for path in sorted((root / "docs").rglob("*.md")):
        found += bindings(path.relative_to(root / "docs").as_posix(), path.read_text())
    return found
