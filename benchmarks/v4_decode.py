"""A random DeepSeek-V4 (the tests' three-layer "three-types" shape: sliding, CSA
and HCA layers, hash and routed MoE), decoding greedily, DeepInfer against
transformers on the same weights in float32.

    python benchmarks/v4_decode.py [--batch 8] [--prompt 96] [--new 64] [--rounds 3]

Each round times one batch of ``batch`` prompts of ``prompt`` random tokens,
``new`` tokens each (EOS ignored), on each side in turn; the best round of each
side gives output tokens per second, and the ratio is DeepInfer's over
transformers'; the same again per CPU second (the process's own CPU time,
which other work on a shared machine disturbs less than the clock). Both
sides' greedy tokens are compared and the count of equal replies printed. One
run, on whatever else the machine is doing: read the ratios. Not part of
`make test`.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts
from tests.engine.test_deepseek_v4 import build


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> tuple[float, float]:
    """Wall and CPU seconds since ``start``."""
    wall, cpu = clocks()
    return wall - start[0], cpu - start[1]


def transformers_side(
    model, prompts: list[list[int]], new: int
) -> tuple[tuple[float, float], list[list[int]]]:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    start = clocks()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return since(start), out[:, ids.shape[1] :].tolist()


def engine_side(
    llm: LLM, prompts: list[list[int]], new: int
) -> tuple[tuple[float, float], list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    start = clocks()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return since(start), [o.token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=96)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    path = Path(tempfile.mkdtemp(prefix="v4-bench-"))
    model = build(path, "three-types")
    prompts = [
        x[: args.prompt] for x in random_prompts(args.batch, 5, args.prompt, args.prompt + 1)
    ]
    llm = LLM(path, dtype="float32")
    engine_side(llm, prompts, 4)  # warm up both
    transformers_side(model, prompts, 4)
    ours, theirs = [], []
    for _ in range(args.rounds):
        seconds, ours_tokens = engine_side(llm, prompts, args.new)
        ours.append(seconds)
        seconds, their_tokens = transformers_side(model, prompts, args.new)
        theirs.append(seconds)
    tokens = args.batch * args.new
    same = sum(x == y for x, y in zip(ours_tokens, their_tokens))
    print(f"random DeepSeek-V4 (three-types), float32, {torch.get_num_threads()} threads")
    print(f"batch {args.batch}, {args.prompt}-token prompts, {args.new} new tokens each")
    print(f"{'':14}{'tokens/s':>10}{'per CPU s':>11}")
    for name, runs in (("DeepInfer", ours), ("transformers", theirs)):
        wall, cpu = min(r[0] for r in runs), min(r[1] for r in runs)
        print(f"{name:14}{tokens / wall:10.1f}{tokens / cpu:11.1f}")
    wall = min(r[0] for r in theirs) / min(r[0] for r in ours)
    cpu = min(r[1] for r in theirs) / min(r[1] for r in ours)
    print(f"{'ratio':14}{wall:9.2f}x{cpu:10.2f}x")
    print(f"same greedy replies: {same} of {args.batch}")


if __name__ == "__main__":
    main()
