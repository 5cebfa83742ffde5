"""Counters the engine keeps as it runs; `llm.stats` shows them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    prefill_tokens: int = 0  # tokens scheduled as (chunks of) prompts, recomputes included
    decode_tokens: int = 0  # tokens scheduled as one-token decode steps
    partial_prefills: int = 0  # prompt chunks that stopped short of the prompt's end
    generated_tokens: int = 0
    finished_requests: int = 0
    # Async scheduling: tokens computed for requests that had already finished,
    # because they were scheduled before the step that finished them returned.
    discarded_tokens: int = 0
    forward_seconds: float = 0.0  # time in the model's forward pass and logits
    step_seconds: float = 0.0  # time inside LLMEngine.step, forward included
    # [MoE layer, expert] tokens routed, recomputes included (MTP modules' layers last);
    # None for a model without experts
    expert_tokens: torch.Tensor | None = None
    # With placed experts (expert parallelism or EPLB): [MoE layer, physical slot] rows
    # each slot ran since the placement began; and, per rank, bytes it sent to other
    # ranks in dispatch and in combine. Under expert parallelism these, and
    # expert_tokens, are summed over the ranks when generate returns.
    expert_slot_tokens: torch.Tensor | None = None
    ep_dispatch_bytes: list[int] | None = None
    ep_combine_bytes: list[int] | None = None
