"""Demo: DeepSeek-V3's MTP module drafts for deepinfer-tiny-moe.

deepinfer-tiny-moe is a DeepSeek-V3-shaped model whose checkpoint carries one
multi-token prediction (MTP) module, trained to predict the token after next.
The same greedy requests run without speculation, then with the module
drafting k = 1 and k = 2 tokens a step (for k = 2 the module runs again on its
own output, which it was not trained for). The demo compares the tokens and
counts, for each k, how often the first draft was accepted (of the verify
steps) and the second (of the steps that accepted the first), and the target
passes per output token of a request, (tokens - accepted) / tokens.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL_MOE", "snippets/models/deepinfer-tiny-moe")
PROMPTS = [
    "The scheduler admits a request while the token budget and the free blocks last,",
    "Keys and values live in blocks of the paged cache, and a block table maps",
    "A request waits, runs, is preempted and resumes, and its tokens",
    "Each step, the model runner flattens the scheduled requests into one batch",
]
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


def run(k: int | None) -> tuple[list[list[int]], LLM]:
    spec = None if k is None else {"method": "mtp", "num_speculative_tokens": k}
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=128, speculative_config=spec)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs], llm


def parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def main() -> dict:
    plain, llm = run(None)
    model = llm.llm_engine.executor.model_runner.model
    mtp = parameters(model.model.mtp)
    print(f"parameters: main model {parameters(model) - mtp:,}, MTP module {mtp:,}")
    results: dict = {"main_parameters": parameters(model) - mtp, "mtp_parameters": mtp}
    print(f"{'k':>2} {'same':>5} {'drafted':>8} {'accepted':>9} {'first':>6} {'second':>7} "
          f"{'passes/tok':>10}")  # fmt: skip
    for k in (1, 2):
        tokens, llm = run(k)
        spec = llm.stats.spec_decode
        lengths = spec.accepted_lengths + [0] * (k + 1 - len(spec.accepted_lengths))
        first = sum(lengths[1:]) / spec.num_drafts  # verify steps that kept draft 1
        second = lengths[2] / sum(lengths[1:]) if k == 2 else None
        same = tokens == plain
        shown = "-" if second is None else f"{second:.1%}"
        tokens_out = llm.stats.generated_tokens
        per_token = round((tokens_out - spec.num_accepted_tokens) / tokens_out, 3)
        print(f"{k:>2} {'yes' if same else 'NO':>5} {spec.num_draft_tokens:>8} "
              f"{spec.num_accepted_tokens:>9} {first:>6.1%} {shown:>7} {per_token:>10.3f}")  # fmt: skip
        results |= {
            f"k{k}_same": same,
            f"k{k}_drafted": spec.num_draft_tokens,
            f"k{k}_accepted": spec.num_accepted_tokens,
            f"k{k}_first_pct": round(100 * first, 1),
            f"k{k}_passes_per_token": per_token,
        }
        if second is not None:
            results["k2_second_pct"] = round(100 * second, 1)
    return results


if __name__ == "__main__":
    main()
