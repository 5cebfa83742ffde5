"""Demo: FP8 and int8 KV caches against the exact cache, on the two tiny models.

Each model serves the same greedy requests three times: with the cache in the
model's own dtype (float32 here), and with one-byte FP8 E4M3 and int8 codes
that carry a float32 scale per token and KV head (per 128 latent numbers for
MLA). For each cache the demo prints its bytes per token, read from the engine's
own pool (every layer's block bytes over the block size), and how many of the
generated tokens equal the exact cache's, position by position, with the first
position (from 0) where each request's reply changes, or "-" where none does.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams

MODELS = {
    "tiny": os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny"),
    "tiny-moe": os.environ.get("DEEPINFER_DEMO_MODEL_MOE", "snippets/models/deepinfer-tiny-moe"),
}
FORMATS = ("auto", "fp8_e4m3", "int8")
PROMPTS = [
    "The scheduler admits a request while the token budget and the free blocks last,",
    "Keys and values live in blocks of the paged cache, and a block table maps",
    "A request waits, runs, is preempted and resumes, and its tokens",
    "Each step, the model runner flattens the scheduled requests into one batch",
]
REPLY = 64
BLOCK = 16


def run(model: str, fmt: str) -> tuple[list[list[int]], int]:
    """The greedy replies, and the pool's bytes per token over all layers."""
    llm = LLM(model, dtype="float32", kv_cache_dtype=fmt, block_size=BLOCK, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True)
    replies = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    pool = llm.llm_engine.executor.model_runner.kv_cache
    return replies, pool.block_bytes() // BLOCK


def first_change(a: list[int], b: list[int]) -> int:
    """The first position (from 0) where the replies differ; len(a) if none does."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))


def shown(change: int) -> str:
    return "-" if change == REPLY else str(change)


def main() -> dict:
    results: dict = {"reply": REPLY, "requests": len(PROMPTS)}
    print(f"{len(PROMPTS)} greedy requests, {REPLY} tokens each")
    print(f"{'model':>8} {'cache':>8} {'bytes/tok':>9} {'ratio':>6} {'same':>6}  first change")
    for name, model in MODELS.items():
        exact, exact_bytes = run(model, "auto")
        for fmt in FORMATS:
            replies, per_token = run(model, fmt)
            same = sum(x == y for a, b in zip(replies, exact) for x, y in zip(a, b))
            share = same / (len(PROMPTS) * REPLY)
            changes = [first_change(a, b) for a, b in zip(replies, exact)]
            ratio = per_token / exact_bytes
            print(f"{name:>8} {fmt:>8} {per_token:>9} {ratio:>6.3f} {share:>6.1%}  "
                  f"{' '.join(map(shown, changes))}")  # fmt: skip
            key = f"{name.replace('-', '_')}_{fmt}"
            results |= {
                f"bytes_{key}": per_token,
                f"ratio_{key}": round(ratio, 3),
                f"same_{key}": round(share, 3),
                f"changes_{key}": changes,
            }
    return results


if __name__ == "__main__":
    main()
