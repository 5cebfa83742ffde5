"""Demo: how the trained deepinfer-tiny-moe spreads real text over its experts.

The engine reads a chapter of this book (one the model never saw in training)
in windows, prompt only, and counts the (token, expert) pairs each MoE layer's
router sent to each routed expert (llm.stats.expert_tokens). The demo prints,
per layer, the busiest and the idlest expert and the busiest one's load over
the mean; the whole table is its result, which the heatmap plot draws.

It runs in float64. The counts hang on which experts a token's scores rank
highest, and in float32 two nearly equal scores swap places when another CPU
sums them in another order: a count then moves by one. In float64 the sums of
two machines differ by about 1e-16, far below the closest two scores of any
token here, so every machine routes every token alike.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams
from engine.tools.kv_quality import text_at

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny-moe")
TEXT = "docs/ch01-batching-and-the-kv-cache.md"  # held out from the model's training
# Chapter 1 as this commit has it: an edit to the chapter changes no count here.
TEXT_COMMIT = "e0cd6cab982560c551369779fc5bc383b7e08526"
WINDOW = 512  # tokens per prompt


def windows(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(text_at(TEXT, TEXT_COMMIT)).ids
    return [ids[i : i + WINDOW] for i in range(0, len(ids), WINDOW)]


def main() -> dict:
    llm = LLM(MODEL, dtype="float64", max_num_batched_tokens=4 * WINDOW)
    prompts = windows(llm)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    cfg = llm.llm_engine.config.hf_config
    first = cfg.moe.first_k_dense_replace
    load = llm.stats.expert_tokens[: cfg.num_hidden_layers - first]  # not the MTP module's
    tokens = sum(map(len, prompts))
    print(f"text: {TEXT}")
    print(f"  {tokens} tokens, {len(prompts)} windows of up to {WINDOW}")
    print(f"{cfg.moe.num_experts} experts, top-{cfg.moe.top_k} of each token")
    print(f"pairs per layer: {tokens * cfg.moe.top_k}")
    print(f"{'layer':>5}{'busiest':>9}{'share':>7}{'idlest':>8}{'share':>7}{'max/mean':>10}")
    results: dict = {"text": TEXT, "tokens": tokens, "num_experts": cfg.moe.num_experts}
    results["top_k"], results["first_moe_layer"] = cfg.moe.top_k, first
    results["num_groups"] = cfg.moe.num_groups
    for i, row in enumerate(load):
        share = row.double() / row.sum()
        hi, lo = int(share.argmax()), int(share.argmin())
        ratio = float(share.max() * len(row))
        print(f"{first + i:>5}{hi:>9}{share[hi]:>7.1%}{lo:>8}{share[lo]:>7.1%}{ratio:>10.2f}")
        layer = first + i
        results[f"load_layer_{layer}"] = row.tolist()
        results[f"busiest_expert_layer_{layer}"] = hi
        results[f"busiest_share_layer_{layer}"] = round(float(share[hi]), 3)  # as printed
        results[f"idlest_share_layer_{layer}"] = round(float(share[lo]), 3)
        results[f"max_over_mean_layer_{layer}"] = round(ratio, 2)
    results["moe_layers"] = [first + i for i in range(len(load))]
    return results


if __name__ == "__main__":
    main()
