"""Demo: EPLB on deepinfer-tiny-moe's recorded load, across EP processes.

The engine runs prompts (windows of a chapter of this book) with one slot per
expert, the experts in order on the ranks, and records each rank's tokens.
Then llm.rebalance_experts() asks EPLB's policy for a placement with REDUNDANT
extra slots per layer, for the load recorded, and moves every rank to it; the
same prompts run again. Prefix caching is off, so that the second run routes
the same tokens as the first instead of only those the cache does not hold.
Per MoE layer the demo prints the imbalance (the busiest rank's rows over the
mean rank's) measured in each run, next to the policy's own estimate on the
first run's load; it checks that the tokens are identical, and shows the
policy's estimate for more ranks.

It runs in float64, as demo_expert_load.py does and for the same reason: in
float32 a nearly tied pair of router scores ranks differently on another CPU,
and every count and ratio here would move with it.
"""

from __future__ import annotations

import os

import torch

from engine import LLM, SamplingParams
from engine.distributed.eplb import imbalance, rebalance_experts
from engine.tools.kv_quality import text_at

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny-moe")
TEXT = "docs/ch01-batching-and-the-kv-cache.md"
# Chapter 1 as this commit has it: an edit to the chapter changes no count here.
TEXT_COMMIT = "e0cd6cab982560c551369779fc5bc383b7e08526"
EP, REDUNDANT = 2, 4
PROMPTS, PROMPT_LEN, MAX_TOKENS = 8, 64, 16
MORE_RANKS = (4, 8)  # the policy alone, one redundant slot per rank


def prompts(llm: LLM) -> list[list[int]]:
    ids = llm.tokenizer.encode(text_at(TEXT, TEXT_COMMIT)).ids
    return [ids[i * PROMPT_LEN : (i + 1) * PROMPT_LEN] for i in range(PROMPTS)]


def estimate(load, experts: int, groups: int, ranks: int, extra: int) -> tuple[float, float]:
    """EPLB's worst layer, on this load: with the experts in order, and placed."""
    identity = imbalance(load, torch.arange(experts).repeat(len(load), 1), ranks)
    phy2log, _, _ = rebalance_experts(load, experts + extra, groups, 1, ranks)
    return max(identity), max(imbalance(load, phy2log, ranks))


def main() -> dict:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    # No prefix cache: the second run must route the tokens the placement was fitted to.
    llm = LLM(MODEL, dtype="float64", expert_parallel_size=EP, enable_prefix_caching=False)
    engine, batch = llm.llm_engine, prompts(llm)
    first_run = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    cfg = engine.config.hf_config
    layers = cfg.num_hidden_layers - cfg.moe.first_k_dense_replace  # not the MTP module
    before = engine.eplb.rank_imbalance()[:layers]
    load = llm.stats.expert_tokens[:layers].clone()
    report = llm.rebalance_experts(num_redundant=REDUNDANT)
    estimated = imbalance(load, report.placement.phy2log[:layers], EP)
    second_run = [o.token_ids for o in llm.generate(batch, params, use_tqdm=False)]
    after = engine.eplb.rank_imbalance()[:layers]
    second_load = llm.stats.expert_tokens[:layers] - load
    llm.shutdown()
    same = second_run == first_run
    same_load = bool(torch.equal(second_load, load))
    experts, slots = cfg.moe.num_experts, report.placement.phy2log.shape[1]
    print(f"EP={EP}: {experts} experts; EPLB adds {REDUNDANT} slots")
    print(f"  a layer: {slots} slots, {slots // EP} a rank")
    print(f"(token, expert) pairs a layer, each run: {int(load[0].sum())}")
    print(f"same pairs in both runs: {same_load}")
    print("busiest rank's rows over the mean:")
    print(f"{'':>5}{'measured':>10}{'estimate':>10}{'measured':>10}")
    print(f"{'layer':>5}{'in order':>10}{'EPLB':>10}{'EPLB':>10}  copied")
    first = cfg.moe.first_k_dense_replace
    placed = report.placement.logcnt[:layers]
    results: dict = {"ep": EP, "redundant": REDUNDANT, "slots": slots, "same_tokens": same}
    results["pairs_per_layer"] = int(load[0].sum())
    results["same_load"] = same_load
    for i in range(layers):
        copied = [e for e, n in enumerate(placed[i].tolist()) if n > 1]
        names = ",".join(map(str, copied))
        row = f"{first + i:>5}{before[i]:>10.3f}{estimated[i]:>10.3f}{after[i]:>10.3f}"
        print(f"{row}  {names}")
        results[f"imbalance_before_layer_{first + i}"] = round(before[i], 3)
        results[f"estimate_layer_{first + i}"] = round(estimated[i], 3)
        results[f"imbalance_after_layer_{first + i}"] = round(after[i], 3)
        results[f"copied_layer_{first + i}"] = copied
    worst = max(range(layers), key=lambda i: before[i])  # the least even layer, in order
    gained = sum(a < b for a, b in zip(after, before))
    print(f"evener after EPLB: {gained} of {layers} layers")
    print(f"tokens identical, before and after: {same}")
    results["layers_gained"], results["moe_layers"] = gained, layers
    results["least_even_layer"] = first + worst
    results["least_even_before"] = round(before[worst], 3)
    results["least_even_estimate"] = round(estimated[worst], 3)
    results["least_even_after"] = round(after[worst], 3)
    print("the policy's estimate (worst layer), same load:")
    print(f"{'ranks':>5}{'extra':>7}{'in order':>10}{'EPLB':>8}")
    groups = cfg.moe.num_groups
    for ranks, extra in ((EP, REDUNDANT), *((r, r) for r in MORE_RANKS)):
        was, now = estimate(load, experts, groups, ranks, extra)
        print(f"{ranks:>5}{extra:>7}{was:>10.3f}{now:>8.3f}")
        results[f"estimate_before_ranks_{ranks}"] = round(was, 3)
        results[f"estimate_after_ranks_{ranks}"] = round(now, 3)
    results["more_ranks"] = list(MORE_RANKS)
    return results


if __name__ == "__main__":
    main()
