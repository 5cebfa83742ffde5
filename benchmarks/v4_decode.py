"""A random DeepSeek-V4 (the tests' three-layer "three-types" shape: sliding, CSA
and HCA layers, hash and routed MoE), decoding greedily, DeepInfer against
transformers on the same weights in float32.

    python benchmarks/v4_decode.py [--batch 8] [--prompt 96] [--new 64] [--rounds 3]

Each round times one batch of ``batch`` prompts of ``prompt`` random tokens,
``new`` tokens each (EOS ignored), on each side in turn; the best round of each
side gives output tokens per second, and the ratio is DeepInfer's over
transformers'. Both sides' greedy tokens are compared and the count of equal
replies printed. One run, on whatever else the machine is doing: read the
ratio. Not part of `make test`.
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


def transformers_side(model, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    seconds = time.perf_counter() - start
    return seconds, out[:, ids.shape[1] :].tolist()


def engine_side(llm: LLM, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, [o.token_ids for o in outs]


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
    a, b = tokens / min(ours), tokens / min(theirs)
    same = sum(x == y for x, y in zip(ours_tokens, their_tokens))
    print(f"random DeepSeek-V4 (three-types), float32, {torch.get_num_threads()} threads")
    print(f"batch {args.batch}, {args.prompt}-token prompts, {args.new} new tokens each")
    print(f"DeepInfer     {a:9.1f} tokens/s")
    print(f"transformers  {b:9.1f} tokens/s")
    print(f"ratio         {a / b:9.2f}x")
    print(f"same greedy replies: {same} of {args.batch}")


if __name__ == "__main__":
    main()
