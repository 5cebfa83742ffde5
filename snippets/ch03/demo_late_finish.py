"""Demo: late finishes. With async scheduling, a request that stops on step N's
token was already scheduled in step N+1; the token computed for it is discarded.

The prompts run greedily once with nothing to stop them, to learn each one's
STOP_AT-th token. Then they run again, async off and on, each told to stop
there: the even ones on that token id (a stop token), the odd ones on its text
(a stop string, which the output processor finds, after the scheduler). The
last LENGTH_ONLY requests have no stop and end by max_tokens, which the
scheduler knows before the token arrives. The demo counts the tokens discarded,
and checks that both runs return the same tokens and text, and that every
block is free at the end.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPTS = [
    "def free(self, seq):",
    "The scheduler",
    "class Sequence:",
    "A token is",
    "# Experiment 11",
    "import torch",
    "The model runner",
    "for step in steps:",
]
STOP_AT = 4  # each request stops on the token it generates in this place
LENGTH_ONLY = 2  # the last requests: no stop, only max_tokens
MAX_TOKENS = 12


def stopping_params(llm: LLM, free_run: list[list[int]]) -> list[SamplingParams]:
    params = []
    for i, tokens in enumerate(free_run):
        token = tokens[STOP_AT - 1]
        if i >= len(free_run) - LENGTH_ONLY:
            stop = {}
        elif i % 2:
            stop = {"stop": [llm.tokenizer.decode([token])]}
        else:
            stop = {"stop_token_ids": [token]}
        params.append(SamplingParams(temperature=0, max_tokens=MAX_TOKENS, **stop))
    return params


def main() -> dict:
    probe = LLM(MODEL, dtype="float32")
    free = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free_run = [o.token_ids for o in probe.generate(PROMPTS, free, use_tqdm=False)]
    params = stopping_params(probe, free_run)
    runs = {}
    for name, on in (("off", False), ("on", True)):
        llm = LLM(MODEL, dtype="float32", async_scheduling=on)
        runs[name] = llm, llm.generate(PROMPTS, params, use_tqdm=False)
    (off_llm, off), (on_llm, on) = runs["off"], runs["on"]
    same = [(o.token_ids, o.text) for o in on] == [(o.token_ids, o.text) for o in off]
    reasons = [o.finish_reason for o in on]
    stops, lengths = reasons.count("stop"), reasons.count("length")
    discarded = on_llm.stats.discarded_tokens
    blocks = on_llm.llm_engine.block_manager
    all_free = blocks.num_free_blocks == len(blocks.blocks)
    print(f"{len(PROMPTS)} requests; each but the last {LENGTH_ONLY} stops")
    print(f"  on its token number {STOP_AT}, by id or by text")
    print(f"finished by a stop: {stops}, by max_tokens: {lengths}")
    print(f"tokens and text identical, off and on: {same}")
    print(f"steps: {off_llm.stats.steps} off, {on_llm.stats.steps} on")
    print(f"tokens discarded, async on: {discarded}")
    print(f"tokens discarded, async off: {off_llm.stats.discarded_tokens}")
    print(f"every block free at the end: {all_free}")
    return {
        "requests": len(PROMPTS),
        "stop_at": STOP_AT,
        "length_only": LENGTH_ONLY,
        "stops": stops,
        "lengths": lengths,
        "same_outputs": same,
        "steps_off": off_llm.stats.steps,
        "steps_on": on_llm.stats.steps,
        "discarded_on": discarded,
        "discarded_off": off_llm.stats.discarded_tokens,
        "all_blocks_free": all_free,
    }


if __name__ == "__main__":
    main()
