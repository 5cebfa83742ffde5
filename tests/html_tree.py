"""A small element tree for the built site's HTML, from the standard library's parser.

Enough for the site's tests to ask which element a piece of text sits in: tags,
attributes, children and text, with a few queries. Not a browser: no scripts run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser

VOID = {
    "area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
    "track", "wbr",
}  # fmt: skip


@dataclass(eq=False)
class Element:
    tag: str
    attrs: dict[str, str]
    parent: Element | None = None
    children: list[Element | str] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())

    def iter(self) -> Iterator[Element]:
        yield self
        for child in self.children:
            if isinstance(child, Element):
                yield from child.iter()

    def find_all(self, match: Callable[[Element], bool]) -> list[Element]:
        return [e for e in self.iter() if match(e)]

    def ancestors(self) -> Iterator[Element]:
        node = self.parent
        while node is not None:
            yield node
            node = node.parent

    def text(self) -> str:
        parts = []
        for child in self.children:
            parts.append(child if isinstance(child, str) else child.text())
        return "".join(parts)

    def texts(self) -> Iterator[tuple[str, Element]]:
        """Every run of text, with the element it sits directly in."""
        for child in self.children:
            if isinstance(child, str):
                yield child, self
            else:
                yield from child.texts()


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.node = self.root

    def handle_starttag(self, tag: str, attrs) -> None:
        element = Element(tag, {k: v or "" for k, v in attrs}, self.node)
        self.node.children.append(element)
        if tag not in VOID:
            self.node = element

    def handle_startendtag(self, tag: str, attrs) -> None:
        self.node.children.append(Element(tag, {k: v or "" for k, v in attrs}, self.node))

    def handle_endtag(self, tag: str) -> None:
        node = self.node
        while node is not self.root and node.tag != tag:
            node = node.parent
        if node is not self.root:
            self.node = node.parent

    def handle_data(self, data: str) -> None:
        self.node.children.append(data)


def parse(html: str) -> Element:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.root
