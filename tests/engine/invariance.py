"""One request's logits in many kinds of company: the batch-invariance tests' scenarios.

Each scenario runs the same target request (same prompt, greedy, same length)
in a fresh engine with different other requests around it, and records the
target's logits at every step it samples. Batch invariance means every
scenario records bitwise the same tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts

TARGET = random_prompts(1, seed=90, low=45, high=46)[0]
STEPS = 5
PARAMS = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


def record_logits(llm: LLM, req_id: str) -> list[torch.Tensor]:
    """The rows of ``req_id``'s logits, one per step in which it samples."""
    runner = llm.llm_engine.executor.model_runner
    forward, seen = runner.forward, []

    def recording(step):
        logits = forward(step)
        if req_id in step.batch.req_ids:
            seen.append(logits[step.batch.req_ids.index(req_id)].clone())
        return logits

    runner.forward = recording
    return seen


def others(n: int, seed: int, max_tokens: int = 6) -> list[tuple[list[int], SamplingParams]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [(p, params) for p in random_prompts(n, seed=seed, low=3, high=50)]


def run(path, before=(), after=(), first=(), target=TARGET, **kwargs) -> list[torch.Tensor]:
    """The target's logits with ``before`` queued ahead of it and ``after``
    behind it; ``first`` runs to completion beforehand (to fill the prefix cache)."""
    llm = LLM(path, dtype="float32", **{"num_kv_blocks": 96, **kwargs})
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(first):
        engine.add_request(f"first{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    seen = record_logits(llm, "target")
    for i, (prompt, params) in enumerate(before):
        engine.add_request(f"before{i}", prompt, params)
    engine.add_request("target", target, PARAMS)
    for i, (prompt, params) in enumerate(after):
        engine.add_request(f"after{i}", prompt, params)
    while engine.has_unfinished_requests():
        engine.step()
    assert len(seen) == STEPS
    return seen


def scenarios(path, **kwargs) -> dict[str, Callable[[], list[torch.Tensor]]]:
    """Name -> a run of the target in that company: where it stands in the
    batch, how many share its steps, how its prompt is cut into chunks, whether
    part of it is found in the prefix cache, and whether it is preempted."""
    shared = [(TARGET[:32] + p, PARAMS) for p in random_prompts(1, seed=91, low=4, high=5)]
    return {
        "alone": lambda: run(path, **kwargs),
        "behind 3": lambda: run(path, before=others(3, 92), **kwargs),
        "ahead of 9": lambda: run(path, after=others(9, 93), **kwargs),
        "among 20 decodes": lambda: run(path, before=others(8, 94), after=others(11, 95), **kwargs),
        "chunked by 16": lambda: run(
            path, before=others(2, 96), max_num_batched_tokens=16, **kwargs
        ),
        "chunked by 11": lambda: run(
            path, after=others(3, 97), max_num_batched_tokens=11, **kwargs
        ),
        "prefix hit": lambda: run(path, first=shared, after=others(2, 98), **kwargs),
        "preempted": lambda: run(
            path, before=others(3, 99, 24), num_kv_blocks=12, block_size=8, **kwargs
        ),
    }


def compare(scenarios: dict[str, Callable[[], list[torch.Tensor]]]) -> dict[str, bool]:
    """Name -> are the target's logits in that scenario bitwise those alone?"""
    runs = {name: fn() for name, fn in scenarios.items()}
    alone = runs["alone"]
    return {name: all(map(torch.equal, got, alone)) for name, got in runs.items()}
