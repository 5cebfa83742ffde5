"""What the correctness guarantees cost: batch-invariant mode, and structured output.

    python -m engine.tools.correctness_bench [--model DIR] [--requests 64] [--repeats 1000]
                                             [--rounds 3]

1. Throughput of the same greedy requests with batch-invariant mode off and
   on, and the ratio: the best of --rounds runs each, taken in turns.
2. Greedy completions of one prompt, each among random other requests: how
   many distinct completions with the mode off and on.
3. Structured output at a batch of ``--requests``: the time per step spent
   filling the grammar masks and applying them, against the whole step.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sample import sampler as sampler_module

PROMPTS = ["def step(self):", "The scheduler admits", "class Block:", "# Chapter 7", "x = "]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "blocks": {"type": "integer"}},
    "required": ["name", "blocks"],
}


def throughput(model: str, requests: int, max_tokens: int, rounds: int = 1) -> tuple[float, float]:
    """Output tokens per second with the mode off and on: the best of ``rounds``
    runs each, off and on taking turns, so that a busy neighbour on a shared
    machine slows both sides alike rather than one."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [PROMPTS[i % len(PROMPTS)] * (1 + i % 3) for i in range(requests)]
    engines = [LLM(model, batch_invariant=inv, max_num_seqs=requests) for inv in (False, True)]
    best = [0.0, 0.0]
    for _ in range(rounds):
        for i, llm in enumerate(engines):
            llm.generate(prompts[:2], params, use_tqdm=False)  # warm up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            rate = sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start)
            best[i] = max(best[i], rate)
    return best[0], best[1]


def distinct_completions(model: str, repeats: int, invariant: bool) -> int:
    rng = random.Random(repeats)
    target = "def schedule(self) -> SchedulerOutput:"
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts, params = [], []
    for _ in range(repeats):
        for _ in range(rng.randrange(4)):
            prompts.append(rng.choice(PROMPTS) * rng.randint(1, 4))
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 9)))
        prompts.append(target)
        params.append(greedy)
    llm = LLM(model, batch_invariant=invariant, enable_prefix_caching=False, max_num_seqs=64)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return len({tuple(o.token_ids) for o, p in zip(outs, prompts) if p == target})


def structured_overhead(model: str, requests: int) -> tuple[float, float, int]:
    """(seconds per step filling and applying masks, seconds per step, steps)."""
    llm = LLM(model, max_num_seqs=requests)
    manager, spent = llm.llm_engine.structured_output, [0.0]
    fill, apply = manager.fill_bitmask, sampler_module.apply_grammar_bitmask

    def timed(fn):
        def run(*args):
            start = time.perf_counter()
            result = fn(*args)
            spent[0] += time.perf_counter() - start
            return result

        return run

    manager.fill_bitmask = timed(fill)
    sampler_module.apply_grammar_bitmask = timed(apply)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    params = [
        SamplingParams(seed=i, max_tokens=40, structured_outputs=spec) for i in range(requests)
    ]
    steps0, seconds0 = llm.stats.steps, llm.stats.step_seconds
    llm.generate([PROMPTS[i % len(PROMPTS)] for i in range(requests)], params, use_tqdm=False)
    sampler_module.apply_grammar_bitmask = apply
    steps = llm.stats.steps - steps0
    return spent[0] / steps, (llm.stats.step_seconds - seconds0) / steps, steps


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="snippets/models/deepinfer-tiny")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    off, on = throughput(args.model, args.requests, args.max_tokens, args.rounds)
    print(f"greedy, {args.requests} requests x {args.max_tokens} tokens,")
    print(f"  best of {args.rounds} runs each, off and on taking turns:")
    print(f"  batch-invariant off: {off:.0f} output tokens/s")
    print(f"  batch-invariant on:  {on:.0f} output tokens/s")
    print(f"  off / on: {off / on:.2f}x")
    for invariant in (False, True):
        n = distinct_completions(args.model, args.repeats, invariant)
        print(
            f"{args.repeats} greedy completions in random company, mode "
            f"{'on' if invariant else 'off'}: {n} distinct"
        )
    mask, step, steps = structured_overhead(args.model, args.requests)
    print(f"structured output (JSON schema), batch {args.requests}, {steps} steps:")
    print(f"  masks {mask * 1e3:.2f} ms of a {step * 1e3:.2f} ms step ({mask / step:.1%})")


if __name__ == "__main__":
    main()
