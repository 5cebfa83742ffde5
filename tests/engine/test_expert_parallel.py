"""Expert parallelism across processes: the same greedy tokens as one process, on
the trained deepinfer-tiny-moe (also after an EPLB re-balance with redundant
experts) and on a random tiny DeepSeek-V3, under chunked prefill and preemption;
and a worker's death is a clear error, in bounded time, that leaves no process
behind.

Starting ranks is slow (each is a fresh Python that imports torch and loads the
model), so each test module shares its engines, one alive at a time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.executor.multiproc_executor import WorkerDiedError
from tests.conftest import ROOT, wait_gone
from tests.engine.conftest import random_prompts

TINY_MOE = ROOT / "snippets" / "models" / "deepinfer-tiny-moe"
# Small batches and a small cache: prompts are chunked and requests preempted.
STRESS = {"max_num_batched_tokens": 16, "num_kv_blocks": 14, "block_size": 4}
PARAMS = SamplingParams(temperature=0, max_tokens=16)
TEXT_PROMPTS = [
    "def schedule(self) -> SchedulerOutput:",
    "The expert",
    "import torch\n",
    "class MoE(nn.Module):",
]


def run(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]


@pytest.fixture(scope="module")
def tiny_moe_one_process():
    llm = LLM(TINY_MOE, dtype="float32", **STRESS)
    return run(llm, TEXT_PROMPTS), llm.stats


def test_ep2_matches_one_process_on_tiny_moe(tiny_moe_one_process) -> None:
    tokens, stats = tiny_moe_one_process
    llm = LLM(TINY_MOE, dtype="float32", expert_parallel_size=2, **STRESS)
    try:
        pids = llm.llm_engine.executor.pids
        assert run(llm, TEXT_PROMPTS) == tokens
        ep = llm.stats
        assert ep.partial_prefills > 0 and ep.preemptions > 0, ep
        # The same schedule, so the same routing: the ranks' counts add up to one's.
        assert torch.equal(ep.expert_tokens, stats.expert_tokens)
        assert len(ep.ep_dispatch_bytes) == 2 and min(ep.ep_dispatch_bytes) > 0
        assert min(ep.ep_combine_bytes) > 0
        # Every (token, expert) pair ran once, on one rank's slot.
        assert ep.expert_slot_tokens.sum() == ep.expert_tokens.sum()
        report = llm.rebalance_experts(num_redundant=4)  # 20 slots, 10 a rank
        assert max(report.imbalance_after) <= max(report.imbalance_before)
        assert run(llm, TEXT_PROMPTS) == tokens  # the same output, placed anew
    finally:
        del llm  # shuts the worker down
    assert not wait_gone(pids), "a worker outlived its LLM"


def test_ep2_matches_one_process_on_random_deepseek(deepseek) -> None:
    """The random tiny DeepSeek-V3 of the transformers oracle: 8 experts, 4 groups."""
    path, _ = deepseek
    prompts = random_prompts(4, seed=4, high=20)
    one = LLM(path, dtype="float32", **STRESS)
    expected = run(one, prompts)
    llm = LLM(path, dtype="float32", expert_parallel_size=2, **STRESS)
    try:
        assert run(llm, prompts) == expected
        assert llm.stats.partial_prefills > 0 and llm.stats.preemptions > 0
    finally:
        llm.shutdown()


def test_ep4_matches_one_process_on_random_deepseek(deepseek) -> None:
    path, _ = deepseek
    prompts = random_prompts(3, seed=5, high=20)
    expected = run(LLM(path, dtype="float32", max_num_batched_tokens=16), prompts)
    llm = LLM(path, dtype="float32", expert_parallel_size=4, max_num_batched_tokens=16)
    try:
        assert run(llm, prompts) == expected
        assert len(llm.stats.ep_dispatch_bytes) == 4
    finally:
        llm.shutdown()


def test_ep2_matches_one_process_on_deepseek_v4(tmp_path) -> None:
    """DeepSeek-V4's experts spread over two ranks, its hash layer's router reading
    each rank's share of the token ids: the one-process tokens under chunked
    prefill and preemption, and again after EPLB re-places the experts with two
    redundant slots. The hash layer keeps the placement an even load gets; a top-k
    layer is placed for its recorded load."""
    from engine.distributed.eplb import rebalance_experts
    from tests.engine.test_deepseek_v4 import PROMPTS, REGIMES, build

    build(tmp_path, "three-types")  # layer 0 hash-routed, layers 1 and 2 top-k; 8 experts
    stress = REGIMES["preemption"]
    expected = run(LLM(tmp_path, dtype="float32", **stress), PROMPTS)
    llm = LLM(tmp_path, dtype="float32", expert_parallel_size=2, **stress)
    try:
        assert run(llm, PROMPTS) == expected
        assert llm.stats.preemptions > 0 and llm.stats.partial_prefills > 0
        assert min(llm.stats.ep_dispatch_bytes) > 0
        report = llm.rebalance_experts(num_redundant=2)  # 10 slots, 5 a rank
        even, _, _ = rebalance_experts(torch.ones(1, 8), 10, 1, 1, 2)
        assert torch.equal(report.placement.phy2log[0], even[0])  # the hash layer
        load = llm.stats.expert_tokens[1:].float()
        placed, _, _ = rebalance_experts(load, 10, 1, 1, 2)
        assert torch.equal(report.placement.phy2log[1:], placed)  # the top-k layers
        assert run(llm, PROMPTS) == expected
    finally:
        llm.shutdown()


def test_a_killed_worker_makes_generate_raise_and_leaves_no_process(deepseek) -> None:
    path, _ = deepseek
    llm = LLM(path, dtype="float32", expert_parallel_size=2)
    pids = llm.llm_engine.executor.pids
    run(llm, [[5, 6, 7]])
    os.kill(pids[0], signal.SIGKILL)
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            run(llm, random_prompts(3, seed=1))
        except BaseException as e:  # noqa: BLE001 (the test inspects it)
            errors.append(e)

    thread = threading.Thread(target=generate, daemon=True)
    thread.start()
    thread.join(120)  # a bound on the wait, not a speed claim: a hang fails here
    assert not thread.is_alive(), "generate hung after a worker died"
    assert len(errors) == 1 and isinstance(errors[0], WorkerDiedError), errors
    assert "rank 1" in str(errors[0])
    with pytest.raises(WorkerDiedError):  # and so does every later call
        run(llm, [[5, 6, 7]])
    assert not wait_gone(pids)


CTRL_C = """
import sys
from engine import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", expert_parallel_size=2)
print(*llm.llm_engine.executor.pids, flush=True)
while True:
    llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8), use_tqdm=False)
"""


def test_ctrl_c_stops_the_engine_and_its_workers(deepseek) -> None:
    """SIGINT reaches the engine's process, as a terminal's Ctrl-C would: it exits,
    and its worker goes with it (at exit, or when the kernel sees its parent die)."""
    path, _ = deepseek
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", CTRL_C, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        # As a shell starts it: Ctrl-C's default action, whatever this process was left with.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids, proc.stderr.read()
        time.sleep(1.0)  # in the middle of generating
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    assert not wait_gone(pids + [proc.pid])
