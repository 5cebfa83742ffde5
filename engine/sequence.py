"""A request as the scheduler tracks it: its tokens, how many are in the KV cache,
and which cache blocks hold them. Its text, logprobs and timings belong to the
output processor."""

from __future__ import annotations

from enum import Enum, auto
from itertools import count
from typing import TYPE_CHECKING

from engine.outputs import EngineCoreEvent, FinishReason
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.kv.handoff import Handoff
    from engine.structured_output import StructuredOutputRequest


class SequenceStatus(Enum):
    WAITING = auto()  # queued, or preempted and queued again
    RUNNING = auto()  # holds cache blocks and is scheduled every step
    WAITING_FOR_KV = auto()  # holds cache blocks an outside source is loading (kv/connector.py)
    FINISHED = auto()


class RequestTokens:
    """A request's tokens: its prompt, then every token it has kept. The
    scheduler's Sequence and a proposer's DraftRequest both read them so."""

    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


class Sequence(RequestTokens):
    """One request. Everything the scheduler decides follows from two numbers:
    how many tokens the sequence has (``num_tokens``) and how many of them
    already have keys and values in the cache (``num_computed_tokens``)."""

    _arrivals = count()

    def __init__(
        self, request_id: str, token_ids: list[int], params: SamplingParams, seed: int = 0
    ) -> None:
        self.seq_id = next(Sequence._arrivals)  # arrival order: lower is older
        self.request_id = request_id
        self.params = params  # when to stop, and how the model runner samples
        self.seed = seed  # the request's own random stream (see sample/sampler.py)
        self.token_ids = list(token_ids)  # prompt, then every generated token
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0  # tokens whose K and V are in the cache
        # A block table per KV-cache group (config/cache_groups.py): block_tables[0] is
        # the token group's; the block manager adds any others.
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[bytes] = []  # hash chain of the full, computed blocks
        # With a kv_window: the tokens computed before it first gave a block back,
        # whose keys saw the whole context; only their blocks may be published.
        self.num_unwindowed_tokens: int | None = None  # None: nothing given back yet
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0  # found in the prefix cache at the first admission
        self.events: list[EngineCoreEvent] = []  # what the scheduler did, not yet reported
        self.structured_output: StructuredOutputRequest | None = None  # its grammar's matcher
        # Drafts the model runner's proposer made after token spec_at - 1 (runner/drafting.py),
        # and its confidence in each (None: it has none), for the next step: stale once
        # that is no longer the sequence's newest token.
        self.spec_token_ids: list[int] = []
        self.spec_confidence: tuple[float, ...] | None = None
        self.spec_at = 0
        # Handed on by another engine (kv/handoff.py): its blocks load from the store.
        self.handoff: Handoff | None = None

    @property
    def block_table(self) -> list[int]:
        """The token group's table: logical block i -> physical block id, or HOLE."""
        return self.block_tables[0]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
