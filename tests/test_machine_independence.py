"""A record holds only what every correct machine prints (snippets/_runner.py,
"What a record may hold"). Each snippet that runs torch or the engine runs again
here under environments that make torch, oneDNN, MKL and the C++ op choose other
float kernels, as another CPU would, and must print and return its records."""

from __future__ import annotations

import pytest

from tests.conftest import load_runner

runner = load_runner()
CASES = [(path, env) for path in runner.engine_snippets() for env in runner.PERTURBATIONS]


@pytest.mark.parametrize("path, env", CASES, ids=[f"{p}[{e}]" for p, e in CASES])
def test_record_holds_on_other_float_kernels(path: str, env: str) -> None:
    problem = runner.check_one(path, runner.PERTURBATIONS[env])
    if problem:
        pytest.fail(
            f"{path} prints or returns other records under {env} "
            f"({runner.PERTURBATIONS[env]}): what it shows depends on the machine.\n\n"
            f"{problem}\nRound the value, print it on a '{runner.VARIES}' line, or make the "
            "computation exact.",
            pytrace=False,
        )


def test_the_engine_demos_are_all_checked() -> None:
    demos = [p for p in runner.discover() if runner.is_demo(p)]
    assert demos and set(demos) <= set(runner.engine_snippets())


def test_a_varies_line_is_checked_for_place_not_content() -> None:
    recorded = "steps: 6\n~ largest diff 1.9e-06\ntokens: 1 distinct\n"
    assert runner.matches(recorded, recorded.replace("1.9e-06", "2.9e-06"))
    assert not runner.matches(recorded, recorded.replace("6\n", "7\n"))
    assert not runner.matches(recorded, "steps: 6\ntokens: 1 distinct\n")  # the line went
    assert not runner.matches(recorded, recorded.replace("~ largest", "largest"))


@pytest.mark.parametrize("value", [1.9073486328125e-06, 0.1 + 0.2, 2 / 3])
def test_a_demo_may_not_return_a_float_with_its_last_bits(value: float) -> None:
    with pytest.raises(ValueError, match="last bits"):
        runner.check_results("snippets/ch07/demo_x.py", {"diff": value})
    assert runner.check_results("snippets/ch07/demo_x.py", {"diff": round(value, 4)})
    assert runner.check_results("snippets/ch07/e23_x.py", {"diff": value})  # stdlib floats


def test_the_perturbed_environment_reaches_the_snippet() -> None:
    env = runner.fixed_env(runner.PERTURBATIONS["avx2-2-threads"])
    assert env["OMP_NUM_THREADS"] == "2" and env["DNNL_MAX_CPU_ISA"] == "AVX2"
    assert runner.fixed_env()["OMP_NUM_THREADS"] == "1"
    assert "DNNL_MAX_CPU_ISA" not in runner.fixed_env()
