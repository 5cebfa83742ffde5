"""What the scheduler decides for one step, in terms the model runner can read
without knowing the scheduler: request ids, token ids, block ids and settings.

Everything here is plain data, so that a model runner in another process
(Chapter 4's expert parallelism) can receive it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch
# A token id that is not known yet: the token that a step still running will sample.
# Only async scheduling writes it (async_scheduler.py); the model runner finds the
# token on the device (future_tokens.py).
PLACEHOLDER = -1
# A block table's entry for a block a sliding window gave back (EngineConfig.kv_window):
# position p still maps to entry p // block_size, and the model runner leaves the
# hole out of what attention reads (runner/input_batch.py, kept_blocks).
HOLE = -1


def padded(tables: list[list[int]]) -> list[list[int]]:
    """Block tables as rows of one width, padded with HOLE, for one tensor."""
    width = max((len(table) for table in tables), default=0)
    return [list(table) + [HOLE] * (width - len(table)) for table in tables]


@dataclass
class NewRequestData:
    """A request the model runner has not seen: what it keeps until the request ends."""

    req_id: str
    sampling_params: SamplingParams
    seed: int  # the request's own random stream (see sample/sampler.py)
    num_prompt_tokens: int  # so that the runner knows each sampled token's output position
    # For a repetition penalty, and for prompt logprobs (the tokens they score).
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class ScheduledRequest:
    """One request's share of a step. Its drafts, if any, end ``token_ids``: the
    request's own tokens never include a draft until the model accepts it."""

    req_id: str
    token_ids: list[int]  # the new tokens, whose keys and values this step computes
    num_computed_tokens: int  # tokens already in the cache: token_ids[0] sits at this position
    # Per KV-cache group (config/cache_groups.py), logical -> physical block, or HOLE:
    # the sequence's own lists (async: copies).
    block_tables: tuple[list[int], ...]
    samples: bool  # does this step reach the request's last token, so that it samples after it?
    # Proposed tokens, the tail of token_ids (only when samples): each is checked
    # against the token sampled at the position before it (sched/scheduler.py).
    draft_token_ids: list[int] = field(default_factory=list)
    # Only when it samples and has penalties: its output tokens so far, the newest
    # perhaps a PLACEHOLDER (async scheduling); None otherwise.
    output_token_ids: list[int] | None = None

    @property
    def block_table(self) -> list[int]:
        """The token group's table, which every attention backend reads."""
        return self.block_tables[0]

    @property
    def num_new_tokens(self) -> int:
        """Every token whose keys and values this step computes, drafts included."""
        return len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


@dataclass
class GrammarOutput:
    """The token masks of the step's rows that sample under a grammar."""

    # Row i of the bitmask belongs to req_ids[i]; a request with drafts has a row
    # per verified position, one after the other, in order.
    req_ids: list[str]
    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32, on the host


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted_req_ids: list[str] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # ended since the last step
    grammar: GrammarOutput | None = None  # None when no row samples under a grammar
