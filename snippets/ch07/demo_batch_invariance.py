"""Demo: one request's logits in different company, with batch-invariant mode
off and on, compared bit for bit.

The target prompt runs alone, then behind COMPANY[i] other requests, then with
its prompt cut into chunks of CHUNK tokens, all on the torch attention backend.
At each of its MAX_TOKENS steps its logits are compared with the run alone:
bitwise equal, or not, and by how much.
Then REPEATS copies of it run among other requests, greedy, and the demo counts
the distinct completions.

With the mode off, which steps keep their bits, and by how much the others
move, depends on the CPU and its math library: those lines begin with "~",
and the check compares only that they are there. What holds on every machine
is printed plainly: every step within TOLERANCE of the run alone, and the
mode-on counts.
"""

from __future__ import annotations

import os

import torch

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
TARGET = "def schedule(self) -> SchedulerOutput:\n    budget ="
OTHERS = ["class Block:", "The prefix cache", "# Chapter 7", "return tokens", "x = 1"]
COMPANY = [1, 4, 12]
CHUNK = 8
MAX_TOKENS = 6
REPEATS = 100
TOLERANCE = 1e-4  # far above float32's last bits on logits of this size
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def target_logits(invariant: bool, ahead: int, **kwargs) -> list[torch.Tensor]:
    llm = LLM(
        MODEL,
        dtype="float32",
        batch_invariant=invariant,
        num_kv_blocks=128,
        attention_backend="torch",
        **kwargs,
    )
    engine, runner, seen = llm.llm_engine, llm.llm_engine.executor.model_runner, []
    forward = runner.forward

    def recording(step):  # keep the target's row of every step's logits
        logits = forward(step)
        if "target" in step.batch.req_ids:
            seen.append(logits[step.batch.req_ids.index("target")].clone())
        return logits

    runner.forward = recording
    for i in range(ahead):
        params = SamplingParams(temperature=0, max_tokens=3 + i % 5, ignore_eos=True)
        engine.add_request(f"other{i}", OTHERS[i % len(OTHERS)] * (1 + i % 3), params)
    engine.add_request("target", TARGET, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    return seen


def distinct_completions(invariant: bool) -> int:
    """REPEATS copies of the target among other requests: how many answers?"""
    llm = LLM(
        MODEL,
        dtype="float32",
        batch_invariant=invariant,
        enable_prefix_caching=False,
        max_num_seqs=16,
        attention_backend="torch",
    )
    prompts, params = [], []
    for i in range(REPEATS):
        prompts += [TARGET, OTHERS[i % len(OTHERS)] * (1 + i % 4)]
        params += [GREEDY, SamplingParams(temperature=0, max_tokens=1 + i % 7)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return len({tuple(o.token_ids) for o in outs[::2]})


def compare(mode: str, runs: dict, alone: list, results: dict) -> None:
    """Each run's steps against the run alone; off, the counts vary with the machine."""
    mark = "~" if mode == "off" else " "
    worst = 0.0
    for name, got in runs.items():
        equal = sum(map(torch.equal, got, alone))
        diff = max((g - a).abs().max().item() for g, a in zip(got, alone))
        worst = max(worst, diff)
        print(f"{mark} {name:<12} {equal} of {len(alone)}, largest diff {diff:.1e}")
        if mode == "on":
            results[f"on_{name.replace(' ', '_')}_equal"] = equal
            results["on_total_equal"] = results.get("on_total_equal", 0) + equal
    print(f"  every step within {TOLERANCE:.0e} of alone: {worst <= TOLERANCE}")
    results[f"{mode}_within_tolerance"] = worst <= TOLERANCE


def main() -> dict:
    results: dict = {"max_tokens": MAX_TOKENS, "chunk": CHUNK, "repeats": REPEATS}
    results["tolerance"] = TOLERANCE
    for invariant in (False, True):
        mode = "on" if invariant else "off"
        alone = target_logits(invariant, 0)
        runs = {f"behind {n}": target_logits(invariant, n) for n in COMPANY}
        runs[f"chunks of {CHUNK}"] = target_logits(invariant, 1, max_num_batched_tokens=CHUNK)
        print(f"batch-invariant {mode}: steps bitwise equal to alone")
        compare(mode, runs, alone, results)
        distinct = distinct_completions(invariant)
        print(f"  {REPEATS} greedy completions in company: {distinct} distinct")
        print()
        results[f"{mode}_distinct"] = distinct
    results["steps_compared"] = MAX_TOKENS * (len(COMPANY) + 1)
    return results


if __name__ == "__main__":
    main()
