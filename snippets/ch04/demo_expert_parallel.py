"""Demo: expert parallelism across processes, against one process.

The same prompts (windows of a chapter of this book) run greedily on
deepinfer-tiny-moe twice: in one process, and with its routed experts spread
over EP ranks, each rank a process of its own in a torch.distributed (gloo)
group. The demo checks that the tokens are identical, and prints the bytes
each rank sent to the other ranks: its tokens' rows out to the experts
(dispatch) and the expert outputs back to their tokens (combine).
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams
from engine.tools.kv_quality import text_at

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny-moe")
TEXT = "docs/ch01-batching-and-the-kv-cache.md"
# Chapter 1 as this commit has it: an edit to the chapter changes no count here.
TEXT_COMMIT = "e0cd6cab982560c551369779fc5bc383b7e08526"
EP = 2  # ranks
PROMPTS, PROMPT_LEN, MAX_TOKENS = 4, 48, 16


def prompts(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(text_at(TEXT, TEXT_COMMIT)).ids
    return [ids[i * PROMPT_LEN : (i + 1) * PROMPT_LEN] for i in range(PROMPTS)]


def main() -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    one = LLM(MODEL, dtype="float32")
    batch = prompts(one)
    expected = [o.token_ids for o in one.generate(batch, params, use_tqdm=False)]
    llm = LLM(MODEL, dtype="float32", expert_parallel_size=EP)
    got = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    llm.shutdown()
    stats, cfg = llm.stats, llm.llm_engine.config.hf_config
    same = got == expected
    row_bytes = cfg.hidden_size * 4  # float32
    pairs = int(stats.expert_tokens.sum())
    crossed = sum(stats.ep_combine_bytes) // row_bytes  # each came back as one row
    print(f"{PROMPTS} prompts of {PROMPT_LEN} tokens, {MAX_TOKENS} new each")
    print(f"tokens identical, EP={EP} and one process: {same}")
    print(f"steps: {stats.steps}; (token, expert) pairs: {pairs}")
    print(f"  sent to another rank's expert: {crossed} ({crossed / pairs:.0%})")
    print(f"a hidden row: {cfg.hidden_size} floats, {row_bytes} bytes")
    print("bytes each rank sent to the others:")
    print(f"{'rank':>4}{'dispatch':>11}{'combine':>11}{'total':>11}")
    results: dict = {"ep": EP, "prompts": PROMPTS, "prompt_len": PROMPT_LEN}
    results |= {"max_tokens": MAX_TOKENS, "same_tokens": same, "steps": stats.steps}
    results |= {"pairs": pairs, "pairs_crossed": crossed, "row_bytes": row_bytes}
    for rank, (d, c) in enumerate(zip(stats.ep_dispatch_bytes, stats.ep_combine_bytes)):
        print(f"{rank:>4}{d:>11,}{c:>11,}{d + c:>11,}")
    results["dispatch_bytes"] = stats.ep_dispatch_bytes
    results["combine_bytes"] = stats.ep_combine_bytes
    total = sum(stats.ep_dispatch_bytes) + sum(stats.ep_combine_bytes)
    per_pair = round(total / crossed)  # printed and quoted alike
    print(f"all ranks: {total:,} bytes, {per_pair} a crossing pair")
    results["total_bytes"] = total
    results["bytes_per_crossing_pair"] = per_pair
    return results


if __name__ == "__main__":
    main()
