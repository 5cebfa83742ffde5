"""The boxes a reader learns once and then recognises: every chapter opens with a
box of the same name, each kind of box the pages use has a colour of its own in
book.css, and a box of one kind never stands in for another's title."""

from __future__ import annotations

import re

from tests.conftest import ROOT

PAGES = sorted((ROOT / "docs").glob("*.md"))
CSS = (ROOT / "docs" / "assets" / "stylesheets" / "book.css").read_text()
BOX = re.compile(r'^(?:!!!|\?\?\?\+?) ([\w-]+)(?: "([^"]*)")?', re.M)
COLOUR = re.compile(r"\.(?P<kind>[\w-]+) \{\s*--box-rgb: (?P<rgb>[\d, ]+);")


def boxes() -> list[tuple[str, str, str]]:
    """(page, kind, title) of every admonition on every page."""
    return [(p.name, m[1], m[2] or "") for p in PAGES for m in BOX.finditer(p.read_text())]


def test_every_chapter_opens_with_the_same_box() -> None:
    opening = {
        p.name: BOX.search(p.read_text())[2]
        for p in PAGES
        if p.name.startswith("ch") and p.read_text().find('!!! info "') >= 0
    }
    assert len(set(opening.values())) == 1, opening


def test_each_kind_of_box_has_a_colour_of_its_own() -> None:
    colours = {m["kind"]: m["rgb"] for m in COLOUR.finditer(CSS)}
    used = {kind for _, kind, _ in boxes() if kind.startswith("claim-") or kind == "predict"}
    assert used <= colours.keys(), used - colours.keys()
    shown = [colours[k] for k in sorted(used)]
    assert len(set(shown)) == len(shown), {k: colours[k] for k in used}


def test_a_title_belongs_to_one_kind() -> None:
    kinds: dict[str, set[str]] = {}
    for _, kind, title in boxes():
        if kind.startswith("claim-"):
            kinds.setdefault(title, set()).add(kind)
    assert all(len(k) == 1 for k in kinds.values()), kinds
    assert kinds["Built, and only modelled"] == {"claim-built"}
