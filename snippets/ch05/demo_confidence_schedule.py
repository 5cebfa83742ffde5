"""Demo: the confidence schedule gives each request in one batch its own k.

Four greedy requests decode on deepinfer-tiny with drafts from
deepinfer-tiny-draft, at most K = 6 each. The step-time profile is given, not
measured, so that every machine makes the same choices: a step costs a fixed
1.0 plus PER_TOKEN for each token it computes. After the prompts' first
step, the draft proposes for all four; the schedule scores each draft by the
product of the draft's confidences up to it (its gain) and takes drafts, best
gain first, while the batch's expected tokens per unit of step time rise, and
at most BUDGET of them (the fixed schedule verifies every draft, up to K: the
budget binds the confidence schedule only). Then both schedules run the
requests to the end, and the profile prices each run: its steps times the
fixed cost, plus PER_TOKEN for every token its steps computed.
"""

from __future__ import annotations

import os
import tempfile

from engine import LLM, SamplingParams
from engine.spec_decode import Draft
from engine.spec_decode.verify_length import StepShape, StepTimeProfile, choose_lengths, gains

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
DRAFT = "snippets/models/deepinfer-tiny-draft"
K, BUDGET, PER_TOKEN = 6, 10, 0.05
PROMPTS = [
    "for seq in self.running:\n    n = self.num_new_tokens(seq)\n    for seq in self.",
    "The scheduler admits a request while the token budget and the free blocks last.",
    "Keys and values live in blocks of the paged cache. Keys and values",
    "A request waits, runs, is preempted and resumes;",
]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def engine_with(schedule: str, profile: str) -> LLM:
    config = {"method": "draft_model", "num_speculative_tokens": K, "model": DRAFT,
              "verify_schedule": schedule, "verify_budget": BUDGET,
              "step_time_profile": profile}  # fmt: skip
    if schedule == "fixed":
        config = {k: v for k, v in config.items() if k in ("method", "num_speculative_tokens",
                                                           "model")}  # fmt: skip
    return LLM(MODEL, dtype="float32", num_kv_blocks=128, speculative_config=config)


def one_batch(llm: LLM, profile: StepTimeProfile) -> tuple[list[int], list[int]]:
    """The schedule's choice for the batch after the prompts' step, printed; and,
    not printed, its choice for the same batch with a budget of 4 (Exercise 5)."""
    engine = llm.llm_engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    engine.step()  # the prompts, and each request's first token
    seqs = list(engine.scheduler.running)
    # The drafts the runner's proposer made after each request's first token.
    drafts = {s.request_id: Draft(s.spec_token_ids, None, s.spec_confidence) for s in seqs}
    shape = StepShape(len(seqs), len(seqs))
    lengths = choose_lengths(drafts, shape, BUDGET, profile)
    at_four = choose_lengths(drafts, shape, 4, profile)
    print(f"one batch, k <= {K}, budget {BUDGET}:")
    print("each request's draft gains, and the k chosen")
    for seq in seqs:
        g = gains(drafts[seq.request_id])
        shown = " ".join(f"{x:.2f}" for x in g)
        print(f"  {seq.request_id}: {shown} -> k = {lengths[seq.request_id]}")
    while engine.has_unfinished_requests():
        engine.step()
    ids = [seq.request_id for seq in seqs]
    return [lengths[r] for r in ids], [at_four[r] for r in ids]


def run(llm: LLM) -> tuple[list[list[int]], dict]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    s, spec = llm.stats, llm.stats.spec_decode
    cost = s.steps + PER_TOKEN * (s.prefill_tokens + s.decode_tokens)
    return [o.token_ids for o in outs], {
        "drafted": spec.num_draft_tokens,
        "accepted": spec.num_accepted_tokens,
        "steps": s.steps,
        "cost": round(cost, 2),
        "tokens_per_cost": round(s.generated_tokens / cost, 3),
    }


def main() -> dict:
    profile = StepTimeProfile((1, 1001), (1.0, 1.0 + 1000 * PER_TOKEN))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        profile.save(path)
        chosen, at_four = one_batch(engine_with("confidence", path), profile)
        rows = {name: run(engine_with(name, path)) for name in ("fixed", "confidence")}
    print()
    print(f"{'schedule':<10} {'drafted':>7} {'accepted':>8} {'rate':>6} {'steps':>5} "
          f"{'cost':>6} {'tok/cost':>8}")  # fmt: skip
    for name, (_, c) in rows.items():
        rate = c["accepted"] / c["drafted"]
        print(f"{name:<10} {c['drafted']:>7} {c['accepted']:>8} {rate:>6.1%} {c['steps']:>5} "
              f"{c['cost']:>6.2f} {c['tokens_per_cost']:>8.3f}")  # fmt: skip
    same = rows["fixed"][0] == rows["confidence"][0]
    print(f"same tokens under both schedules: {'yes' if same else 'NO'}")
    results = {"k": K, "budget": BUDGET, "per_token": PER_TOKEN, "chosen": chosen, "same": same,
               "chosen_at_budget_4": at_four}  # fmt: skip
    for name, (_, c) in rows.items():
        results |= {f"{name}_{key}": value for key, value in c.items()}
    return results


if __name__ == "__main__":
    main()
