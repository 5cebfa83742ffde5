"""Demo: a KV cache too small for the batch. Requests are preempted and resumed,
none is lost, and every output equals a run with room to spare.

Six short prompts that will each grow by MAX_TOKENS generated tokens share a
cache of NUM_BLOCKS blocks of BLOCK_SIZE tokens, fewer slots than the six need
by the end. The demo drives the engine step by step and reports, in the order
the scheduler acted, each request it sent back to the queue (preempted, its
blocks freed) and each one it brought back (resumed, recomputing what is not
still in the prefix cache). Then it runs the same requests in ROOMY_BLOCKS blocks.
"""

from __future__ import annotations

import os

from engine import LLM, RequestOutput, SamplingParams
from engine.outputs import EngineCoreEventType

PREEMPTED = EngineCoreEventType.PREEMPTED
MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPTS = [
    "def free(self, seq):",
    "The prefix cache",
    "class Scheduler:",
    "A block is",
    "# Experiment 5",
    "return tokens",
]
BLOCK_SIZE = 16
NUM_BLOCKS = 11
ROOMY_BLOCKS = 256
MAX_TOKENS = 40


def scheduler_events(outputs: dict[str, RequestOutput]) -> list[tuple[str, str, int, int, int]]:
    """Every preemption and resumption, in the order the scheduler acted:
    (kind, request, step, its tokens, tokens found in the prefix cache).
    Each request's output carries what the scheduler did to it; the events'
    index orders them across requests, even within one step."""
    found = []
    for name, out in outputs.items():
        admissions = [e for e in out.events if e.type is EngineCoreEventType.SCHEDULED]
        found += [(e, "resumed", name) for e in admissions[1:]]  # back after a preemption
        found += [(e, "preempted", name) for e in out.events if e.type is PREEMPTED]
    found.sort()  # events compare by their index
    return [(kind, name, e.step, e.num_tokens, e.num_cached_tokens) for e, kind, name in found]


def run_to_completion(llm: LLM, names: list[str], params: SamplingParams) -> dict:
    engine = llm.llm_engine
    for name, prompt in zip(names, PROMPTS):
        engine.add_request(name, prompt, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return outputs


def main() -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    names = [f"r{i}" for i in range(len(PROMPTS))]
    tight = LLM(MODEL, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    outputs = run_to_completion(tight, names, params)

    grown = sum(len(o.prompt_token_ids) + len(o.token_ids) for o in outputs.values())
    slots = NUM_BLOCKS * BLOCK_SIZE
    print(f"{len(PROMPTS)} requests grow to {grown} tokens in all;")
    print(f"  the cache has {NUM_BLOCKS} blocks of {BLOCK_SIZE}, {slots} slots")
    print()
    results: dict = {}
    order: dict[str, list] = {"preempted": [], "resumed": []}
    for kind, name, step, tokens, cached in scheduler_events(outputs):
        nth = sum(n == name for n in order[kind])  # earlier events of this kind
        key = f"{name}_{kind}" + (f"_{nth + 1}" if nth else "")
        order[kind].append(name)
        results[f"{key}_step"] = step
        if kind == "preempted":
            print(f"step {step:>3}: preempted {name} ({tokens} tokens), its blocks freed")
        else:
            print(f"step {step:>3}: resumed {name}, {cached} of its {tokens} tokens cached")
            results[f"{key}_cached"] = cached
            results[f"{key}_tokens"] = tokens

    roomy = LLM(MODEL, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=ROOMY_BLOCKS)
    reference = run_to_completion(roomy, names, params)
    computed_tight, computed_roomy = (
        llm.stats.prefill_tokens + llm.stats.decode_tokens for llm in (tight, roomy)
    )
    same = all(outputs[n].token_ids == reference[n].token_ids for n in names)
    print()
    print(f"steps: {tight.stats.steps}, preemptions: {tight.stats.preemptions},")
    print(f"  finished: {len(outputs)} of {len(PROMPTS)}")
    print("tokens computed:")
    print(f"  {computed_tight} with {NUM_BLOCKS} blocks, {computed_roomy} with {ROOMY_BLOCKS}")
    print(f"every output identical to the run with {ROOMY_BLOCKS} blocks: {same}")
    return {
        "requests": len(PROMPTS),
        "max_tokens": MAX_TOKENS,
        "block_size": BLOCK_SIZE,
        "num_blocks": NUM_BLOCKS,
        "roomy_blocks": ROOMY_BLOCKS,
        "slots": slots,
        "tokens_at_end": grown,
        "preempted_order": order["preempted"],
        "resumed_order": order["resumed"],
        **results,
        "steps": tight.stats.steps,
        "preemptions": tight.stats.preemptions,
        "finished": len(outputs),
        "computed_tight": computed_tight,
        "computed_roomy": computed_roomy,
        "same_outputs": same,
    }


if __name__ == "__main__":
    main()
