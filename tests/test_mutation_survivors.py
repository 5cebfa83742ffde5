"""tests/mutation_survivors.md, which `make mutate` reads to tell the survivors
judged equivalent from those still to kill: every entry names its mutants in
full under the heading of a module in the mutation scope, once each, with a
reason; and the report counts exactly those as explained."""

from __future__ import annotations

import re

from tests.conftest import ROOT, load_script

score = load_script(ROOT / "tests" / "mutation_score.py", "mutation_score")
TEXT = score.SURVIVORS.read_text(encoding="utf-8")


def test_the_report_counts_only_the_named_survivors_as_explained() -> None:
    text = "## engine.kv.store.disk\n\n- `xǁDiskStoreǁput__mutmut_2`, `x__size__mutmut_1`: why.\n"
    assert score.explained(text) == {
        "engine.kv.store.disk.xǁDiskStoreǁput__mutmut_2",
        "engine.kv.store.disk.x__size__mutmut_1",
    }
    results = [
        "engine.kv.store.disk.xǁDiskStoreǁput__mutmut_1: killed",
        "engine.kv.store.disk.xǁDiskStoreǁput__mutmut_2: survived",
        "engine.kv.store.disk.xǁDiskStoreǁput__mutmut_3: survived",
    ]
    table = score.report(score.tally(results), score.explained(text))
    assert "engine.kv.store.disk                   3      1     2  33.3%         1" in table
    assert table.endswith(
        "not explained:\n  engine.kv.store.disk.xǁDiskStoreǁput__mutmut_3: survived"
    )


def test_every_explained_survivor_is_named_once_under_a_module_in_scope() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    scope = re.search(r"^only_mutate = \[(.*?)^\]", pyproject, flags=re.M | re.S)[1]
    in_scope = {p.replace("/", ".") for p in re.findall(r'^\s*"(engine/[\w/]+)\.py"', scope, re.M)}
    headings = re.findall(r"^## (.+)$", TEXT, flags=re.M)
    assert headings and set(headings) <= in_scope
    names: list[str] = []
    for entry in re.findall(r"^- (.+)$", TEXT, flags=re.M):
        found = re.findall(r"`(x[ǁ_][\wǁ]*__mutmut_\d+)`", entry)
        assert found, f"an entry names no mutant: {entry}"
        assert re.search(r"\): \S", entry), f"an entry gives no reason: {entry}"
        names += found
    assert len(score.explained(TEXT)) == len(names)  # none twice
