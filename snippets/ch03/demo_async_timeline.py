"""Demo: the engine's step timeline, with async scheduling off and on.

BATCH prompts each generate MAX_TOKENS tokens on the tiny model, once with
async_scheduling off and once on, each run with a step trace (trace=True):
when each stage of each step ran, and on which thread. The demo prints what
the traces show on any machine: the stages each thread ran, and for how many
pairs of steps the inputs of step N+1 were built before step N's tokens were
folded in. How long each stage took depends on the machine, so it prints no
time. Under `make regen` it also saves steps FIRST_SHOWN to LAST_SHOWN of both
traces for the plot (snippets/plots/engine_timeline.py).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPTS = [
    "def schedule(self):",
    "The forward pass",
    "class ModelRunner:",
    "A placeholder is",
    "# Experiment 10",
    "while True:",
    "The GPU waits",
    "return outputs",
]
BATCH = len(PROMPTS)
MAX_TOKENS = 16
FIRST_SHOWN, LAST_SHOWN = 4, 8  # decode steps, past the prompts' step
DATA = Path("snippets/plots/data/engine_timeline.json")


def traced_run(async_scheduling: bool) -> LLM:
    llm = LLM(MODEL, dtype="float32", async_scheduling=async_scheduling, trace=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    return llm


def in_a_thread_that_ends(run, *args):
    """run(*args) in a thread of its own, which ends when it returns. PyTorch's
    OpenMP keeps a pool of threads for each thread that ran a model, for as
    long as that thread lives; one left on the main thread by the "off" run
    would slow every forward pass of the "on" run's worker (see the text)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(run(*args)))
    thread.start()
    thread.join()
    return result[0]


def built_ahead(llm: LLM) -> int:
    """The steps N whose next step's inputs were built before N's tokens were folded in."""
    spans = {(s.stage, s.step): s for s in llm.llm_engine.trace.spans}
    steps = llm.stats.steps
    return sum(spans["prepare", n + 1].end <= spans["update", n].start for n in range(1, steps))


def lanes(llm: LLM) -> dict[str, str]:
    """The thread each stage ran on: one name, or several joined."""
    found: dict[str, set[str]] = {}
    for s in llm.llm_engine.trace.spans:
        found.setdefault(s.stage, set()).add(s.lane)
    return {stage: "+".join(sorted(names)) for stage, names in found.items()}


def window(llm: LLM) -> list[list]:
    """The spans of the steps shown, in ms from the first one's start."""
    shown = [s for s in llm.llm_engine.trace.spans if FIRST_SHOWN <= s.step <= LAST_SHOWN]
    origin = min(s.start for s in shown)
    ms = [(s.start - origin) * 1e3 for s in shown], [(s.end - origin) * 1e3 for s in shown]
    return [[s.step, s.stage, s.lane, round(a, 4), round(b, 4)] for s, a, b in zip(shown, *ms)]


def main() -> dict:
    runs = {"off": in_a_thread_that_ends(traced_run, False), "on": traced_run(True)}
    print(f"{BATCH} requests, {MAX_TOKENS} tokens each, greedy")
    results: dict = {"batch": BATCH, "max_tokens": MAX_TOKENS}
    for name, llm in runs.items():
        steps, ahead, lane = llm.stats.steps, built_ahead(llm), lanes(llm)
        print(f"async {name}: {steps} steps")
        stages_on: dict[str, list[str]] = {}
        for stage, thread in lane.items():
            stages_on.setdefault(thread, []).append(stage)
        for thread, stages in stages_on.items():
            print(f"  {thread}: {', '.join(stages)}")
        print(f"  built before the step before is folded in: {ahead} of {steps - 1}")
        results[f"steps_{name}"] = steps
        results[f"built_ahead_{name}"] = ahead
        results[f"forward_lane_{name}"] = lane["forward"]
        results[f"prepare_lane_{name}"] = lane["prepare"]
        results[f"schedule_lane_{name}"] = lane["schedule"]
        results[f"discarded_{name}"] = llm.stats.discarded_tokens
    same = [o.token_ids for o in runs["on"].outputs] == [o.token_ids for o in runs["off"].outputs]
    print(f"tokens identical, off and on: {same}")
    results["same_tokens"] = same
    results["first_shown"], results["last_shown"] = FIRST_SHOWN, LAST_SHOWN
    if os.environ.get("SNIPPETS_RECORD"):  # make regen: the measured shape, for the plot
        data = {name: window(llm) for name, llm in runs.items()}
        DATA.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            f'"{n}": [\n' + ",\n".join(json.dumps(r) for r in spans) for n, spans in data.items()
        ]
        DATA.write_text("{\n" + "\n],\n".join(rows) + "\n]\n}\n")  # a span a line
    return results


if __name__ == "__main__":
    main()
