"""Benchmark expert parallelism: the same workload at EP=1, 2, ..., as ratios.

    python -m engine.tools.ep_bench [--model PATH] [--sizes 1,2] [--prompts 8]

Each size runs the workload once to warm up, then once measured, on a fresh
LLM: the mean time of a prefill step and of a decode step, their ratio to the
first size's, and the bytes every rank sent to the others per step. The greedy
tokens of every size must equal the first size's, or the table says so.
On one machine, ranks share its cores: on a CPU the extra ranks add processes
and all-to-alls, not compute, so this measures the cost of the machinery.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.tools.bench import random_prompts

DEFAULT_MODEL = "snippets/models/deepinfer-tiny-moe"


@dataclass
class Timing:
    prefill_ms: float  # mean step with prompt tokens in it
    decode_ms: float  # mean step of one-token decodes only
    bytes_per_step: float  # all ranks, dispatch and combine
    tokens: list[list[int]]


def measure(model: str, size: int, prompts: list[list[int]], output_len: int, **kw) -> Timing:
    llm = LLM(model, expert_parallel_size=size, **kw)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    try:
        llm.generate(prompts, params, use_tqdm=False)  # warm-up
        engine = llm.llm_engine
        for i, p in enumerate(prompts):
            engine.add_request(f"m{i}", p, params)
        spans: dict[str, list[float]] = {"prefill": [], "decode": []}
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            before = llm.stats.prefill_tokens
            start = time.perf_counter()
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.token_ids
            kind = "prefill" if llm.stats.prefill_tokens > before else "decode"
            spans[kind].append(time.perf_counter() - start)
        engine.eplb.sync_stats()
        sent = sum(llm.stats.ep_dispatch_bytes or [0]) + sum(llm.stats.ep_combine_bytes or [0])
        steps = llm.stats.steps
    finally:
        llm.shutdown()
    mean = {k: 1e3 * sum(v) / max(len(v), 1) for k, v in spans.items()}
    tokens = [done[f"m{i}"] for i in range(len(prompts))]
    return Timing(mean["prefill"], mean["decode"], sent / steps, tokens)


def run(
    model: str = DEFAULT_MODEL,
    sizes: tuple[int, ...] = (1, 2),
    num_prompts: int = 8,
    input_len: int = 64,
    output_len: int = 32,
    **llm_kwargs,
) -> str:
    llm_kwargs.setdefault("dtype", "float32")
    vocab = LLM(model, **llm_kwargs).llm_engine.config.hf_config.vocab_size
    prompts = random_prompts(num_prompts, input_len, input_len, vocab, seed=0)
    timings = {n: measure(model, n, prompts, output_len, **llm_kwargs) for n in sizes}
    base = timings[sizes[0]]
    lines = [
        f"{num_prompts} prompts of {input_len} tokens, {output_len} generated each; "
        f"{torch.get_num_threads()} torch threads a rank",
        "",
        f"{'EP':>3}{'prefill ms':>12}{'ratio':>9}{'decode ms':>11}{'ratio':>9}"
        f"{'bytes/step':>12}  tokens",
    ]
    for n, t in timings.items():
        same = "same" if t.tokens == base.tokens else "DIFFER"
        lines.append(
            f"{n:>3}{t.prefill_ms:>12.1f}{t.prefill_ms / base.prefill_ms:>8.2f}x"
            f"{t.decode_ms:>11.1f}{t.decode_ms / base.decode_ms:>8.2f}x"
            f"{t.bytes_per_step:>12,.0f}  {same}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", default="1,2", help="EP sizes, comma-separated")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    sizes = tuple(int(s) for s in args.sizes.split(","))
    print(
        run(
            args.model,
            sizes,
            args.prompts,
            args.input_len,
            args.output_len,
            device=args.device,
        )
    )


if __name__ == "__main__":
    main()
