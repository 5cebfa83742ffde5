"""Demo: two proposers on text that repeats itself, and what they save.

The same four greedy requests run three times on deepinfer-tiny: without
speculation, with prompt lookup (n-gram, k = 4), and with the small draft
model deepinfer-tiny-draft (k = 4). Each run's tokens are compared with the
first's, and the engine's counters say how many drafts were proposed and
accepted. A request's step yields its accepted drafts and one token more, so
its target passes per output token are (tokens - accepted) / tokens: 1
without speculation, less for every accepted draft. (The batch's own step
count says less: the batch runs until its slowest request is done.)
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
DRAFT = "snippets/models/deepinfer-tiny-draft"
K = 4
PROMPTS = [
    "def free(self, seq):\n    for block_id in seq.block_table:\n        self._release(block_id)\n"
    "    seq.block_table.clear()\n\ndef free_tail(self, seq, n):\n    for block_id in",
    "The scheduler admits a request while the token budget and the free blocks last. "
    "A request that is admitted runs until it finishes or is preempted. The scheduler",
    "Each step, the scheduler picks the requests that run. Each step, the model runner",
    "for seq in self.running:\n    n = self.num_new_tokens(seq)\n    for seq in self.",
]
METHODS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": K},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": K, "model": DRAFT},
}


def run(config: dict | None) -> tuple[list[list[int]], LLM]:
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=128, speculative_config=config)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [o.token_ids for o in outs], llm


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied embedding counts once


def main() -> dict:
    results: dict = {"k": K, "requests": len(PROMPTS)}
    plain = None
    print(f"{'method':<11} {'same':>4} {'drafted':>7} {'accepted':>8} {'rate':>6} "
          f"{'passes/tok':>10}")  # fmt: skip
    for name, config in METHODS.items():
        tokens, llm = run(config)
        plain = plain or tokens
        s, spec = llm.stats, llm.stats.spec_decode
        same = tokens == plain
        rate = round(spec.num_accepted_tokens / spec.num_draft_tokens, 3) if config else 0.0
        passes = s.generated_tokens - spec.num_accepted_tokens  # one per request-step
        per_token = round(passes / s.generated_tokens, 3)
        print(f"{name:<11} {'yes' if same else 'NO':>4} {spec.num_draft_tokens:>7} "
              f"{spec.num_accepted_tokens:>8} {rate:>6.1%} {per_token:>10.3f}")  # fmt: skip
        results |= {
            f"{name}_same": same,
            f"{name}_drafted": spec.num_draft_tokens,
            f"{name}_accepted": spec.num_accepted_tokens,
            f"{name}_rate_pct": round(100 * rate, 1),
            f"{name}_passes_per_token": per_token,
        }
    results["tokens"] = s.generated_tokens
    print(f"each run: {s.generated_tokens} output tokens")
    target = parameters(llm.llm_engine.executor.model_runner.model)
    draft = parameters(llm.llm_engine.executor.model_runner.drafter.proposer.runner.model)
    print(f"parameters: target {target:,}, draft {draft:,}")
    return results | {"target_parameters": target, "draft_parameters": draft}


if __name__ == "__main__":
    main()
