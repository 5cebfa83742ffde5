"""Demo: DeepSeek-V3's MTP module drafts for deepinfer-tiny-moe.

deepinfer-tiny-moe is a DeepSeek-V3-shaped model whose checkpoint carries one
multi-token prediction (MTP) module, trained to predict the token after next.
The same greedy requests run without speculation, then with the module
drafting k = 1 and k = 2 tokens a step (for k = 2 the module runs again on its
own output, which it was not trained for). The prompts are PROMPTS pieces of
PROMPT_TOKENS tokens of the book's Chapter 1 as TEXT_COMMIT has it, text the
model never trained on, each continued for GEN tokens.

The demo compares the tokens, and counts for each k how often the first draft
was accepted (of the verify steps) and the second (of the steps that accepted
the first), each with a LEVEL Wilson score interval, which treats every verify
step as an independent trial; and the target passes per output token of a
request, (tokens - accepted) / tokens. Shares and bounds to 0.1%.
"""

from __future__ import annotations

import math
import os
from statistics import NormalDist

from engine import LLM, SamplingParams
from engine.tools.kv_quality import text_at

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL_MOE", "snippets/models/deepinfer-tiny-moe")
TEXT = "docs/ch01-batching-and-the-kv-cache.md"  # held out from the model's training
TEXT_COMMIT = "e0cd6cab982560c551369779fc5bc383b7e08526"  # an edit changes nothing here
PROMPTS, PROMPT_TOKENS, GEN = 48, 24, 64
LEVEL = 0.95
GREEDY = SamplingParams(temperature=0, max_tokens=GEN, ignore_eos=True)


def prompts(llm: LLM) -> list[dict]:
    ids = llm.tokenizer.encode(text_at(TEXT, TEXT_COMMIT)).ids
    step = len(ids) // PROMPTS  # spread over the whole chapter
    return [{"prompt_token_ids": ids[i * step : i * step + PROMPT_TOKENS]} for i in range(PROMPTS)]


def run(k: int | None) -> tuple[list[list[int]], LLM]:
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=512, speculative_config=spec)
    outs = llm.generate(prompts(llm), GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], llm


def wilson(hits: int, trials: int) -> tuple[float, float]:
    """The Wilson score interval of a share hits / trials, at LEVEL."""
    z = NormalDist().inv_cdf(0.5 + LEVEL / 2)
    share, spread = hits / trials, z * z / trials
    middle = (share + spread / 2) / (1 + spread)
    half = z * math.sqrt(share * (1 - share) / trials + spread / (4 * trials)) / (1 + spread)
    return middle - half, middle + half


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def share_row(k: int, draft: str, hits: int, trials: int) -> dict:
    low, high = (round(100 * x, 1) for x in wilson(hits, trials))
    share = round(100 * hits / trials, 1)
    print(f"{k:>2} {draft:>6} {hits:>9} {trials:>6} {share:>6.1f}% {low:>5.1f}..{high:.1f}%")
    return {f"k{k}_{draft}_pct": share, f"k{k}_{draft}_low": low, f"k{k}_{draft}_high": high}


def main() -> dict:
    plain, llm = run(None)
    model = llm.llm_engine.executor.model_runner.model
    mtp = parameters(model.model.mtp)
    print(f"parameters: main model {parameters(model) - mtp:,}, MTP module {mtp:,}")
    print(f"{PROMPTS} prompts of {PROMPT_TOKENS} held-out tokens, {GEN} greedy tokens each")
    results: dict = {"main_parameters": parameters(model) - mtp, "mtp_parameters": mtp}
    results |= {"prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS, "gen_tokens": GEN}
    rows = []
    print(f"{'k':>2} {'same':>5} {'drafted':>8} {'accepted':>9} {'passes/tok':>10}")
    for k in (1, 2):
        tokens, llm = run(k)
        spec = llm.stats.spec_decode
        lengths = spec.accepted_lengths + [0] * (k + 1 - len(spec.accepted_lengths))
        rows.append((k, "first", sum(lengths[1:]), spec.num_drafts))  # steps that kept draft 1
        if k == 2:
            rows.append((k, "second", lengths[2], sum(lengths[1:])))  # of those, draft 2
        tokens_out = llm.stats.generated_tokens
        per_token = round((tokens_out - spec.num_accepted_tokens) / tokens_out, 3)
        same = tokens == plain
        print(f"{k:>2} {'yes' if same else 'NO':>5} {spec.num_draft_tokens:>8} "
              f"{spec.num_accepted_tokens:>9} {per_token:>10.3f}")  # fmt: skip
        results |= {
            f"k{k}_same": same,
            f"k{k}_drafted": spec.num_draft_tokens,
            f"k{k}_accepted": spec.num_accepted_tokens,
            f"k{k}_passes_per_token": per_token,
        }
    print(f"acceptance by position, with {LEVEL:.0%} intervals")
    print(f"{'k':>2} {'draft':>6} {'accepted':>9} {'of':>6} {'share':>7} {'interval':>12}")
    for row in rows:
        results |= share_row(*row)
    second, first = (results["k2_second_low"], results["k2_second_high"]), results["k2_first_low"]
    results["k2_second_against_first"] = (
        "lies wholly below" if second[1] < first
        else "lies wholly above" if second[0] > results["k2_first_high"]
        else "overlaps"
    )  # fmt: skip
    return results


if __name__ == "__main__":
    main()
