"""Every link into a repository's files names a fixed revision: a commit or a release tag, never a
branch. A page on `main` can change under a citation; a commit cannot (issue 46)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"
FILE_LINK = re.compile(
    r"https://(?:github\.com|huggingface\.co)/[\w.-]+/[\w.-]+/(?:blob|tree|resolve|raw)/([^/\s)\"'>#]+)"
)
FIXED = re.compile(r"[0-9a-f]{40}|v\d+(?:\.\d+)*")


def unpinned(text: str) -> list[str]:
    return [m.group(0) for m in FILE_LINK.finditer(text) if not FIXED.fullmatch(m.group(1))]


def test_the_checker_tells_a_branch_from_a_commit() -> None:
    assert unpinned("https://github.com/a/b/blob/main/x.md") == ["https://github.com/a/b/blob/main"]
    assert unpinned(f"https://huggingface.co/a/b/blob/{'0a' * 20}/config.json") == []
    assert unpinned("https://github.com/a/b/blob/v5.24.0/src/x.py") == []


def test_every_repository_file_link_is_pinned() -> None:
    found = {p.name: unpinned(p.read_text()) for p in sorted(DOCS.rglob("*.md"))}
    assert {name: links for name, links in found.items() if links} == {}
