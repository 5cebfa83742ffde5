"""The Preface describes the book and the engine as they are: its chapter list is
the site's, every architecture the engine loads is named, and what it says of the
experiments (how many, what they need) is what snippets/ holds. A sentence that
goes stale fails here, not in a reader's hands."""

from __future__ import annotations

import re

import pytest

from tests.conftest import ROOT, load_script

PREFACE = ROOT / "docs" / "index.md"
LINK = re.compile(r"^- \[(?P<title>[^\]]+)\]\((?P<page>[\w-]+\.md)\)", re.M)
# The words the Preface uses for each class the engine's registry maps.
ARCHITECTURE_WORDS = {
    "LlamaForCausalLM": "Llama",
    "Qwen2ForCausalLM": "Qwen2",
    "Qwen3ForCausalLM": "Qwen3",
    "DeepseekV3ForCausalLM": "DeepSeek-V3",
    "DeepseekV32ForCausalLM": "V3.2",
    "DeepseekV4ForCausalLM": "V4",
}


def preface() -> str:
    return PREFACE.read_text()


def book_pages() -> list[str]:
    """The chapters and appendices, in the site's order (mkdocs.yml's nav)."""
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:\n")[1].split("\n\n")[0]
    pages = re.findall(r"^  - ([\w-]+\.md)", nav, re.M)
    return [p for p in pages if re.match(r"(ch\d\d|appendix-[a-z])-", p)]


def test_the_chapter_list_is_the_sites() -> None:
    listed = LINK.findall(preface())
    assert [page for _, page in listed] == book_pages()
    for title, page in listed:
        heading = (ROOT / "docs" / page).read_text().splitlines()[0]
        assert heading == f"# {title}", f"{page}: the Preface says {title!r}, the page {heading!r}"


def test_no_chapter_is_said_to_be_unwritten() -> None:
    text = preface()
    for stale in (
        "still to be written",
        "to be written",
        "is written:",
        ": written",
        "written so far",
    ):
        assert stale not in text, stale


def test_every_architecture_the_engine_loads_is_named() -> None:
    from engine.config.model import SUPPORTED_ARCHITECTURES

    assert set(SUPPORTED_ARCHITECTURES) == set(ARCHITECTURE_WORDS), "name the new one here"
    engine_paragraph = preface().split("DeepInfer lives in this repository")[1].split("\n\n")[0]
    for arch, word in ARCHITECTURE_WORDS.items():
        assert word in engine_paragraph, f"{arch} ({word}) is not named in the Preface"


@pytest.fixture(scope="module")
def experiments():
    site = load_script(ROOT / "docs" / "hooks" / "site.py", "site_hook_front_matter")
    return site.discover_experiments()


def test_what_it_says_of_the_experiments_is_true(experiments) -> None:
    numbers = [e.number for e in experiments]
    assert numbers == list(range(1, len(numbers) + 1))
    said = re.search(r"from Experiment 1 to Experiment (\d+)\.\s+(\w+)\s+one\s+runs", preface())
    assert said, "the Preface no longer says how many experiments there are"
    assert int(said[1]) == len(experiments)
    needy = [e.number for e in experiments if e.needs]
    assert (said[2] == "Every") == (not needy), f"experiments that need more: {needy}"
