"""Counters the engine keeps as it runs; `llm.stats` shows them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counts (vLLM's spec_decode metrics): a verify step
    is one request's step that carried drafts."""

    num_drafts: int = 0  # verify steps
    num_draft_tokens: int = 0  # tokens proposed and checked
    num_accepted_tokens: int = 0
    # accepted_lengths[n]: verify steps that accepted n drafts (a histogram)
    accepted_lengths: list[int] = field(default_factory=list)
    # chosen_lengths[n]: times a request given drafts was scheduled to verify n of
    # them (after the verify-length schedule and the step's limits; a histogram)
    chosen_lengths: list[int] = field(default_factory=list)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        """One request's verify step."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        bump(self.accepted_lengths, num_accepted)

    def observe_chosen(self, num_chosen: int) -> None:
        """One request's drafts, cut to the ``num_chosen`` its step verifies."""
        bump(self.chosen_lengths, num_chosen)

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0 before any)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step: the accepted drafts and the one token after them."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def bump(histogram: list[int], n: int) -> None:
    """Count one more n, growing the histogram to reach it."""
    if len(histogram) <= n:
        histogram += [0] * (n + 1 - len(histogram))
    histogram[n] += 1


@dataclass
class KVTransferStats:
    """The KV cache store's traffic, as the engine's connector sees it (Chapter 8)."""

    loads: int = 0  # loads from the store begun (a preempted request loads again)
    hit_tokens: int = 0  # prompt tokens loaded from the store instead of computed
    handoff_tokens: int = 0  # of those, tokens a prefill worker handed on
    skipped_tokens: int = 0  # found, but recomputing them was estimated cheaper
    failed_blocks: int = 0  # listed, but missing, corrupt or wrong when fetched: recomputed
    loaded_bytes: int = 0
    saved_bytes: int = 0
    saved_blocks: int = 0
    dropped_saves: int = 0  # finished requests not saved: too much already waiting to be
    load_seconds: float = 0.0  # fetching, checking and writing blocks into the pool
    save_seconds: float = 0.0
    # What computing the loaded tokens would have taken, from the measured prefill rate
    recompute_seconds_estimate: float = 0.0


@dataclass(frozen=True)
class KVTransferRecord:
    """One request's traffic with the store: its load, or its save when it ended.
    The front end turns these into per-request histograms (bytes moved, and the
    time moving them against the time computing the same tokens would take)."""

    direction: Literal["load", "save"]
    tokens: int
    nbytes: int
    seconds: float
    recompute_seconds_estimate: float


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
    # With a kv_window: blocks given back while their requests ran, because they
    # held neither a sink nor a token of the window (Scheduler._slide).
    window_freed_blocks: int = 0
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
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    kv_transfer: KVTransferStats = field(default_factory=KVTransferStats)

    @property
    def forwards_per_output_token(self) -> float:
        """Target forward passes (steps) per generated token: 1 or more without
        speculation at batch 1, below 1 when drafts are accepted (0 before any)."""
        return self.steps / self.generated_tokens if self.generated_tokens else 0.0
