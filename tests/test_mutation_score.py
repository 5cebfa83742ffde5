"""`make mutate`'s report: which mutmut statuses count as killed, and which are not judged."""

from __future__ import annotations

from tests.conftest import ROOT, load_script

score = load_script(ROOT / "tests" / "mutation_score.py", "mutation_score")

RESULTS = """\
    engine.kv.block_manager.xǁBlockManagerǁfree__mutmut_1: killed
    engine.kv.block_manager.xǁBlockManagerǁfree__mutmut_2: survived
    engine.kv.block_manager.x_chain_hash__mutmut_1: timeout
    engine.kv.block_manager.x_chain_hash__mutmut_2: no tests
    engine.sample.sampler.x_sample__mutmut_1: skipped
    engine.sample.sampler.x_sample__mutmut_2: not checked
"""


def test_a_module_is_scored_on_the_mutants_it_judged() -> None:
    modules = score.tally(RESULTS.splitlines())
    block_manager = modules["engine.kv.block_manager"]
    assert block_manager.judged == 4
    assert block_manager.score == 0.5  # killed and timeout, of four
    assert block_manager.alive == [
        "engine.kv.block_manager.xǁBlockManagerǁfree__mutmut_2: survived",
        "engine.kv.block_manager.x_chain_hash__mutmut_2: no tests",
    ]
    assert modules["engine.sample.sampler"].judged == 0
    assert "engine.sample.sampler                  0      0     0      -" in score.report(modules)
