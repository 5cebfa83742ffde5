"""Demo: the tiny model generates text, and each request's KV blocks grow with it.

Three prompts of different lengths run together in a cache of NUM_BLOCKS blocks
of BLOCK_SIZE tokens. After every step the demo looks at each request: how
many of its tokens have keys and values in the cache, and how many blocks its
block table holds. It prints a line whenever a request's block count changes,
with the tokens in the cache before and after that step, so you can see which
step brought the new block. A finished request gives all of its blocks back.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
BLOCK_SIZE = 16
NUM_BLOCKS = 32
MAX_TOKENS = 40
PROMPTS = {
    "a": "def schedule(self)",
    "b": "The block manager keeps a free list of blocks, and",
    "c": "# Chapter 2",
}
TEXT_SHOWN = 42  # characters of each output shown


# The one place this demo reads the engine's internals.
def cache_view(engine: LLMEngine, request_id: str) -> tuple[int, int]:
    """(tokens with keys and values in the cache, blocks in the block table);
    (0, 0) once the request has finished and given its blocks back."""
    seq = engine.requests.get(request_id)
    if seq is None:
        return 0, 0
    return seq.num_computed_tokens, len(seq.block_table)


def free_blocks(engine: LLMEngine) -> int:
    return engine.block_manager.num_free_blocks


def main() -> dict:
    llm = LLM(MODEL, dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=NUM_BLOCKS)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, params)

    print(f"{len(PROMPTS)} requests, {MAX_TOKENS} tokens each at most;")
    print(f"{NUM_BLOCKS} blocks of {BLOCK_SIZE} tokens, {free_blocks(engine)} free")
    print()
    print("each change in a request's block count:")
    print(f"{'step':>4}  {'request':<7}  {'tokens in cache':>15}  {'blocks':>6}  {'free':>4}")
    print(f"{'':>4}  {'':<7}  {'':>15}  {'':>6}  {'after':>4}")
    results: dict = {}
    state = {r: cache_view(engine, r) for r in PROMPTS}
    step, finished = 0, {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        for request_id in PROMPTS:
            (was_tokens, was_blocks), now = state[request_id], cache_view(engine, request_id)
            state[request_id] = now
            if now[1] == was_blocks:
                continue
            done = request_id in finished and now == (0, 0)
            tokens = "finished" if done else f"{was_tokens:>3} -> {now[0]:>3}"
            print(
                f"{step:>4}  {request_id:<7}  {tokens:>15}  {now[1]:>6}  {free_blocks(engine):>4}"
            )
            if done:
                results[f"{request_id}_finished_step"] = step
            else:
                key = f"{request_id}_block_{now[1]}"  # e.g. b_block_2: b's second block
                results[f"{key}_step"] = step
                results[f"{key}_tokens_before"] = was_tokens
                results[f"{key}_tokens_after"] = now[0]
        if step == 1:
            results["free_after_step_1"] = free_blocks(engine)
    print()
    print(f"steps: {step}; free blocks at the end: {free_blocks(engine)} of {NUM_BLOCKS}")
    print()
    for request_id, prompt in PROMPTS.items():
        out = finished[request_id]
        text = repr(out.text)
        shown = text if len(text) <= TEXT_SHOWN else text[:TEXT_SHOWN] + "..."
        print(f"[{request_id}] {prompt!r}")
        print(f"    {len(out.prompt_token_ids)} prompt tokens, {len(out.token_ids)} generated")
        print(f"    -> {shown}")
        results[f"{request_id}_prompt_tokens"] = len(out.prompt_token_ids)
        results[f"{request_id}_generated"] = len(out.token_ids)
    return {
        "block_size": BLOCK_SIZE,
        "num_blocks": NUM_BLOCKS,
        "max_tokens": MAX_TOKENS,
        "requests": len(PROMPTS),
        "steps": step,
        "free_at_end": free_blocks(engine),
        **results,
    }


if __name__ == "__main__":
    main()
