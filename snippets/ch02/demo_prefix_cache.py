"""Demo: four questions behind one long shared system prompt. With the prefix
cache, the blocks of the shared prompt are computed once and then found by
their hash; without it, every request computes them again.

The first request runs alone, so its blocks are computed and published before
the other three arrive. Each later request then hits every full block whose
tokens, and all tokens before them, it shares with the first; only the rest of
its prompt is computed.
"""

import os

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
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
params = SamplingParams(temperature=0, max_tokens=16)

for caching in (True, False):
    llm = LLM(MODEL, block_size=16, enable_prefix_caching=caching)
    first = llm.generate([SYSTEM + QUESTIONS[0]], params, use_tqdm=False)
    rest = llm.generate([SYSTEM + q for q in QUESTIONS[1:]], params, use_tqdm=False)
    stats = llm.stats
    print(f"prefix cache {'on' if caching else 'off'}:")
    print(f"  prompt tokens: {sum(len(o.prompt_token_ids) for o in first + rest)}")
    print(f"  prompt tokens found in the prefix cache: {stats.prefix_cache_hit_tokens}")
    print(f"  prompt tokens computed: {stats.prefill_tokens}")
    if caching:
        answers = [o.text for o in first + rest]
    else:
        same = answers == [o.text for o in first + rest]
        print(f"  the same four answers as with the cache: {same}")

shared = len(llm.tokenizer.encode(SYSTEM).ids)
print()
print(
    f"the shared prompt is {shared} tokens: {shared // 16} full blocks of 16, and {shared % 16} over"
)
for q, a in zip(QUESTIONS, answers):
    print(f"{q!r} -> {a!r}")
