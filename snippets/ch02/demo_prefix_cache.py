"""Demo: four questions behind one long shared system prompt. With the prefix
cache, the blocks of the shared prompt are computed once and then found by
their hash; without it, every request computes them again.

The first request runs alone, so its blocks are computed and published before
the other three arrive. Each later request then hits every full block whose
tokens, and all tokens before them, it shares with the first; only the rest of
its prompt is computed.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
BLOCK_SIZE = 16
SYSTEM = (
    "You answer questions about DeepInfer, a small inference engine. The scheduler "
    "decides which sequences run each step. The block manager owns the KV cache "
    "blocks, counts references and keeps a prefix cache of full blocks.\n\n"
)
QUESTIONS = [
    "Q: What is a block?\nA:",
    "Q: Who frees blocks?\nA:",
    "Q: What is a step?\nA:",
    "Q: When is a request preempted?\nA:",
]
MAX_TOKENS = 16
TEXT_SHOWN = 46  # characters shown of each answer


# The one place this demo reads the engine's internals.
def generate(llm: LLM, prompts: dict[str, str]) -> dict[str, tuple[RequestOutput, int]]:
    """Run the prompts together through the step API, as LLM.generate does, and
    return each output with the prompt tokens its request found in the prefix
    cache at admission (the Sequence's num_cached_prompt_tokens)."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    seqs = {}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params)
        seqs[request_id] = engine.requests[request_id]
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
    return {r: (outputs[r], seqs[r].num_cached_prompt_tokens) for r in prompts}


def main() -> dict:
    ids = [f"q{i}" for i in range(len(QUESTIONS))]
    prompts = {r: SYSTEM + q for r, q in zip(ids, QUESTIONS)}
    shared = None
    results: dict = {"block_size": BLOCK_SIZE, "questions": len(QUESTIONS)}
    answers: dict[bool, list[str]] = {}
    for caching in (True, False):
        llm = LLM(MODEL, dtype="float32", block_size=BLOCK_SIZE, enable_prefix_caching=caching)
        if shared is None:
            shared = len(llm.tokenizer.encode(SYSTEM).ids)
            full = shared // BLOCK_SIZE
            print(f"shared system prompt: {shared} tokens,")
            print(f"  {full} full blocks of {BLOCK_SIZE} and {shared % BLOCK_SIZE} over")
            results.update(shared_tokens=shared, shared_full_blocks=full)
            results["shared_full_block_tokens"] = full * BLOCK_SIZE
            results["least_found"] = (len(QUESTIONS) - 1) * full * BLOCK_SIZE
            results["shared_over"] = shared % BLOCK_SIZE
        first = generate(llm, {ids[0]: prompts[ids[0]]})  # alone: computed, then published
        rest = generate(llm, {r: prompts[r] for r in ids[1:]})
        runs = {**first, **rest}
        on = "on" if caching else "off"
        print()
        print(f"prefix cache {on}:")
        print(f"  {'question':<31} {'prompt':>6} {'found':>6} {'computed':>8}")
        for i, (request_id, question) in enumerate(zip(ids, QUESTIONS)):
            out, found = runs[request_id]
            n = len(out.prompt_token_ids)
            label = question.split("\n")[0]
            print(f"  {label:<31} {n:>6} {found:>6} {n - found:>8}")
            results[f"question_{i + 1}_found_cache_{on}"] = found
        total = sum(len(o.prompt_token_ids) for o, _ in runs.values())
        found = llm.stats.prefix_cache_hit_tokens
        print(f"  {'all':<31} {total:>6} {found:>6} {llm.stats.prefill_tokens:>8}")
        results[f"prompt_tokens_cache_{on}"] = total
        results[f"found_cache_{on}"] = found
        results[f"computed_cache_{on}"] = llm.stats.prefill_tokens
        answers[caching] = [runs[r][0].text for r in ids]
    same = answers[True] == answers[False]
    print(f"  the same {len(QUESTIONS)} answers as with the cache: {same}")
    print()
    print("the answers, greedy, from the tiny model:")
    for question, answer in zip(QUESTIONS, answers[True]):
        label, text = question.split("\n")[0], repr(answer)
        print(f"  {label}")
        print(f"    {text if len(text) <= TEXT_SHOWN else text[:TEXT_SHOWN] + '...'}")
    return {**results, "same_answers": same}


if __name__ == "__main__":
    main()
