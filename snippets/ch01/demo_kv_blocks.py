"""Demo: the tiny model generates text, and each request's KV blocks grow with it.

Three prompts of different lengths run together in a cache of 32 blocks of 16
tokens. Every few steps the demo prints, for each request, how many of its
tokens have keys and values in the cache and how many blocks its block table
holds. A block is taken just before the step that writes its first token, and
a finished request gives all of its blocks back.
"""

import os

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPTS = {
    "a": "def schedule(self)",
    "b": "The block manager keeps a free list of blocks, and",
    "c": "# Chapter 2",
}

llm = LLM(MODEL, block_size=16, num_kv_blocks=32)
engine = llm.llm_engine
params = SamplingParams(temperature=0, max_tokens=40)
for request_id, prompt in PROMPTS.items():
    engine.add_request(request_id, prompt, params)


def holdings() -> str:
    cells = []
    for request_id in PROMPTS:
        seq = engine.requests.get(request_id)
        if seq is None:
            cells.append(f"{'done':>9}")
        else:
            cells.append(f"{seq.num_computed_tokens:>4} /{len(seq.block_table):>3}")
    return "  ".join(cells)


print("each cell: tokens in the cache / blocks held (16 tokens a block, 32 blocks in all)")
print(f"{'step':>4}  {'a':>9}  {'b':>9}  {'c':>9}  free blocks")
print(f"{0:>4}  {holdings()}  {engine.block_manager.num_free_blocks:>11}")
step, finished = 0, {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            finished[out.request_id] = out
    step += 1
    if step in (1, 2, 8, 16, 24, 32) or not engine.has_unfinished_requests():
        print(f"{step:>4}  {holdings()}  {engine.block_manager.num_free_blocks:>11}")

print()
for request_id, prompt in PROMPTS.items():
    out = finished[request_id]
    print(f"[{request_id}] {prompt!r} -> {out.text!r} ({out.finish_reason})")
