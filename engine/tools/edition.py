"""Excerpts and editions: how the book quotes the engine, and how a reader
learns whether their checkout still says what the book says.

A page quotes engine code with one directive line, resolved at build time:

    --8<-- "engine/kv/block_manager.py::BlockManager.allocate"   (a qualified name)
    --8<-- "engine/sched/scheduler.py:admission"                    (a named section)
    --8<-- "snippets/ch04/e12_routing_skew.py::route"          (an experiment's function)

A named section is marked in the source with pymdownx.snippets' own markers,
``# --8<-- [start:admission]`` and ``# --8<-- [end:admission]``. The C++ sources
(engine/csrc) mark sections the same way behind ``//``; they have no qualified names.

The edition manifest (``docs/edition.json``) records, for every excerpt a page
shows, its file, name, lines and the sha256 of its text. ``deepinfer edition
check`` compares a checkout with such a manifest.
"""

from __future__ import annotations

import ast
import difflib
import hashlib
import json
import re
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path

MANIFEST = Path("docs/edition.json")

# A directive line in a page. ``::`` introduces a qualified name, ``:`` a section.
DIRECTIVE = re.compile(
    r'^(?P<indent>[ \t]*)--8<-- "(?P<file>(?:engine/[\w/]+\.(?:py|cpp)|snippets/ch\d\d/\w+\.py))'
    r'(?P<sep>::?)(?P<name>[\w.]+)"[ \t]*$'
)
SECTION_MARK = re.compile(r"^\s*(?:#|//) --8<-- \[(?P<end>start|end):(?P<name>\w+)\]\s*$")
SOURCE_GLOBS = ("*.py", "*.cpp")  # the files a page may quote


def engine_sources(root: Path) -> list[Path]:
    return sorted(p for glob in SOURCE_GLOBS for p in (root / "engine").rglob(glob))


class ExcerptError(LookupError):
    """A page names an excerpt that the engine's source does not define."""


@dataclass(frozen=True)
class Excerpt:
    file: str  # path relative to the checkout, e.g. "engine/sched/scheduler.py"
    name: str  # "Scheduler.schedule" or a section name
    kind: str  # "name" or "section"
    start: int  # first line, 1-based
    end: int  # last line, inclusive
    text: str  # dedented source, marker lines removed

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    @property
    def ref(self) -> str:
        return f"{self.file}{'::' if self.kind == 'name' else ':'}{self.name}"


def find_qualname(tree: ast.Module, qualname: str) -> ast.AST | None:
    """Walk class and function bodies along a dotted name."""
    body: list[ast.stmt] = tree.body
    node: ast.AST | None = None
    for part in qualname.split("."):
        node = None
        for stmt in body:
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                if stmt.name == part:
                    node = stmt
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                if any(isinstance(t, ast.Name) and t.id == part for t in targets):
                    node = stmt
        if node is None:
            return None
        body = getattr(node, "body", [])
    return node


def _section_bounds(lines: list[str], name: str) -> tuple[int, int] | None:
    start = None
    for i, line in enumerate(lines, 1):
        m = SECTION_MARK.match(line)
        if m and m["name"] == name:
            if m["end"] == "start":
                start = i + 1
            elif start is not None:
                return start, i - 1
    return None


def extract(root: Path, file: str, name: str, kind: str) -> Excerpt:
    """Return one excerpt from the checkout at ``root``, or raise ExcerptError."""
    path = root / file
    if not path.is_file():
        raise ExcerptError(f"{file} does not exist")
    source = path.read_text()
    lines = source.splitlines()
    if kind == "name":
        if path.suffix != ".py":
            raise ExcerptError(f"{file} is not Python: quote a [start:NAME] section of it")
        node = find_qualname(ast.parse(source, filename=file), name)
        if node is None:
            raise ExcerptError(f"{file} defines no {name!r}")
        decorators = getattr(node, "decorator_list", [])
        start = min([node.lineno] + [d.lineno for d in decorators])
        end = node.end_lineno or node.lineno
    else:
        bounds = _section_bounds(lines, name)
        if bounds is None:
            raise ExcerptError(f"{file} has no section [start:{name}] ... [end:{name}]")
        start, end = bounds
    body = [ln for ln in lines[start - 1 : end] if not SECTION_MARK.match(ln)]
    text = textwrap.dedent("\n".join(body)).strip("\n") + "\n"
    return Excerpt(file, name, kind, start, end, text)


def parse_directive(line: str) -> tuple[str, str, str, str] | None:
    """(indent, file, name, kind) when ``line`` is an excerpt directive."""
    m = DIRECTIVE.match(line)
    if not m:
        return None
    kind = "name" if m["sep"] == "::" else "section"
    return m["indent"], m["file"], m["name"], kind


def defined_sections(root: Path) -> list[tuple[str, str]]:
    """Every (file, section) that the engine's source marks for the book."""
    found = []
    for path in engine_sources(root):
        for line in path.read_text().splitlines():
            m = SECTION_MARK.match(line)
            if m and m["end"] == "start":
                found.append((path.relative_to(root).as_posix(), m["name"]))
    return found


def _names_in(tree: ast.Module) -> set[str]:
    """Qualified names one module defines: its functions, classes and constants;
    each class's methods and class attributes, and what its methods assign to
    ``self``; each function's parameters and locals (an excerpt shows them, so
    the prose may name them)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt], prefix: str, in_class: bool) -> None:
        for stmt in body:
            if isinstance(stmt, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                qual = prefix + stmt.name
                names.add(qual)
                if isinstance(stmt, ast.ClassDef):
                    visit(stmt.body, qual + ".", True)
                    continue
                args = stmt.args
                for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    names.add(f"{qual}.{a.arg}")
                for node in ast.walk(stmt):
                    if not isinstance(getattr(node, "ctx", None), ast.Store):
                        continue
                    if isinstance(node, ast.Name):  # a local the prose may point at
                        names.add(f"{qual}.{node.id}")
                    elif (
                        in_class
                        and isinstance(node, ast.Attribute)
                        and isinstance(node.value, ast.Name)
                        and node.value.id == "self"
                    ):
                        names.add(prefix + node.attr)
            elif isinstance(stmt, ast.Assign | ast.AnnAssign):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
                for t in targets:
                    for node in ast.walk(t):
                        if isinstance(node, ast.Name):
                            names.add(prefix + node.id)

    visit(tree.body, "", False)
    return names


def defined_names(root: Path) -> set[str]:
    """Every qualified name under engine/, without its module: ``Scheduler.schedule``,
    ``BlockManager.free_blocks``, ``chain_hash``, ``DECODE_GROUP``."""
    names: set[str] = set()
    for path in sorted((root / "engine").rglob("*.py")):
        names |= _names_in(ast.parse(path.read_text(), filename=str(path)))
        names.add(path.stem)  # a module may be named too: `block_manager`
    for file, section in defined_sections(root):
        if file.endswith(".cpp"):  # no parser for C++: whatever a shown section names
            text = extract(root, file, section, "section").text
            names |= set(re.findall(r"[A-Za-z_]\w*", text))
    return names


def resolves(ref: str, names: set[str]) -> bool:
    """Does a name the prose quotes exist in the engine? ``Class.member`` must be
    that class's; ``obj.attr.member`` (a variable first) needs only the member;
    a bare ``name`` or ``name()`` may be any definition's last part."""
    parts = ref.split("(")[0].split(".")
    if len(parts) > 1 and parts[0][:1].isupper():
        return ".".join(parts[-2:]) in names or ".".join(parts) in names
    last = parts[-1]
    return any(n == last or n.endswith("." + last) for n in names)


def page_title(markdown: str, fallback: str) -> str:
    for line in markdown.splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return fallback


HTML_COMMENT = re.compile(r"<!--.*?-->", re.S)


def strip_html_comments(markdown: str) -> str:
    """Blank out HTML comments, keeping line numbers: what a comment holds is
    not shown, so a directive inside one must not count as shown."""
    return HTML_COMMENT.sub(lambda m: "\n" * m[0].count("\n"), markdown)


def collect(root: Path) -> list[dict]:
    """Every excerpt every page shows, in page order: the manifest's body."""
    entries = []
    for page in sorted((root / "docs").rglob("*.md")):
        markdown = strip_html_comments(page.read_text())
        rel = page.relative_to(root / "docs").as_posix()
        title = page_title(markdown, rel)
        for line in markdown.splitlines():
            parsed = parse_directive(line)
            if parsed is None:
                continue
            _, file, name, kind = parsed
            ex = extract(root, file, name, kind)
            entries.append(
                {
                    "page": rel,
                    "chapter": title,
                    "file": ex.file,
                    "name": ex.name,
                    "kind": ex.kind,
                    "lines": [ex.start, ex.end],
                    "sha256": ex.sha256,
                    "text": ex.text,
                }
            )
    return entries


def git_edition(root: Path) -> dict[str, str]:
    """The commit and commit date of the checkout, or 'unknown' outside git."""
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "show", "-s", "--format=%H %cs", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return {"commit": out[0], "date": out[1]}
    except (OSError, subprocess.CalledProcessError, IndexError):
        return {"commit": "unknown", "date": "unknown"}


def build_manifest(root: Path) -> dict:
    return {"edition": git_edition(root), "excerpts": collect(root)}


def write_manifest(root: Path) -> Path:
    """Write the manifest with one excerpt a line, so that its diffs read well."""
    manifest = build_manifest(root)
    rows = ",\n".join("  " + json.dumps(e) for e in manifest["excerpts"])
    text = f'{{\n "edition": {json.dumps(manifest["edition"])},\n "excerpts": [\n{rows}\n ]\n}}\n'
    path = root / MANIFEST
    path.write_text(text)
    return path


@dataclass
class Difference:
    status: str  # "changed", "moved" or "vanished"
    entry: dict
    now: Excerpt | None

    def describe(self) -> str:
        e = self.entry
        was = f"{e['file']} lines {e['lines'][0]}-{e['lines'][1]}"
        if self.now is None:
            return f"vanished  {e['name']}  (was {was})"
        now = f"{self.now.file} lines {self.now.start}-{self.now.end}"
        return f"{self.status:<9} {e['name']}  ({was} -> {now})"

    def diff(self) -> str:
        """What changed, as a unified diff of the excerpt's text (editions that
        recorded only a hash can say that it changed, not how)."""
        if self.status != "changed" or "text" not in self.entry or self.now is None:
            return ""
        lines = difflib.unified_diff(
            self.entry["text"].splitlines(keepends=True),
            self.now.text.splitlines(keepends=True),
            fromfile=f"{self.entry['name']} (the book's edition)",
            tofile=f"{self.now.name} (this checkout)",
        )
        return "".join(lines)


def compare(root: Path, manifest: dict) -> list[Difference]:
    """Check every excerpt the manifest lists against the checkout at ``root``."""
    diffs = []
    for entry in manifest["excerpts"]:
        now = _locate(root, entry)
        if now is None:
            diffs.append(Difference("vanished", entry, None))
        elif now.sha256 != entry["sha256"]:
            diffs.append(Difference("changed", entry, now))
        elif (now.file, now.start, now.end) != (entry["file"], *entry["lines"]):
            diffs.append(Difference("moved", entry, now))
    return diffs


def _locate(root: Path, entry: dict) -> Excerpt | None:
    """Find the excerpt in its recorded file, else anywhere under engine/."""
    candidates = [entry["file"]] + [
        p.relative_to(root).as_posix()
        for p in engine_sources(root)
        if p.relative_to(root).as_posix() != entry["file"]
    ]
    for file in candidates:
        try:
            return extract(root, file, entry["name"], entry["kind"])
        except (ExcerptError, SyntaxError):
            continue
    return None


def report(root: Path, manifest: dict, diffs: list[Difference]) -> str:
    """Group the differences chapter by chapter, in the book's order."""
    edition = manifest.get("edition", {})
    head = f"Edition {edition.get('commit', 'unknown')[:12]} ({edition.get('date', 'unknown')})"
    total = len(manifest["excerpts"])
    if not diffs:
        return f"{head}: all {total} excerpts match the checkout at {root}."
    lines = [f"{head}: {len(diffs)} of {total} excerpts differ in the checkout at {root}."]
    chapters: dict[str, list[Difference]] = {}
    for d in diffs:
        chapters.setdefault(d.entry["chapter"], []).append(d)
    for chapter, group in chapters.items():
        lines.append("")
        lines.append(f"{chapter}  [{group[0].entry['page']}]")
        for d in group:
            lines.append(f"  {d.entry['file']}: {d.describe()}")
            lines.extend(f"      {row}" for row in d.diff().splitlines())
    return "\n".join(lines)


def check(root: Path, manifest_path: Path | None = None) -> tuple[int, str]:
    """Exit status and report for ``deepinfer edition check``."""
    root = root.resolve()
    manifest_path = manifest_path or root / MANIFEST
    if not (root / "engine").is_dir():
        return 2, f"error: {root} is not a DeepInfer checkout (no engine/ folder)"
    if not manifest_path.is_file():
        return 2, f"error: no edition manifest at {manifest_path}"
    manifest = json.loads(manifest_path.read_text())
    diffs = compare(root, manifest)
    return (1 if diffs else 0), report(root, manifest, diffs)
