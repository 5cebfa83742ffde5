"""The model runner's requests, and each step's flattened batch built from them.

The runner keeps, for every request it has seen, what sampling needs between
steps (CachedRequestState). Each step it flattens the scheduled requests into
one batch, decodes first (InputBatch.build): token ids, positions, cache
slots, block tables and the rows whose logits are sampled."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine.attention.metadata import AttentionMetadata, decode_query_len
from engine.kv.kv_cache import KVCachePool
from engine.sample.penalties import prompt_mask
from engine.sample.prompt_logprobs import PromptLogprobs, PromptRows, prompt_rows
from engine.sample.rejection_sampler import DraftCheck
from engine.sample.sampler import GrammarMask, SamplingMetadata, SamplingRow
from engine.sampling_params import SamplingParams
from engine.scheduler_output import (
    HOLE,
    GrammarOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
    padded,
)
from engine.utils import to_device


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to turn into logits
    req_ids: list[str]  # the requests that sample, in the order of those rows
    # Per request that samples: the position of its first sampled token among its
    # output tokens, and its drafts, each checked at the row after the one before.
    first_outputs: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    # Per request that samples: its output tokens so far if its penalties need them, else None.
    output_token_ids: list[list[int] | None] = field(default_factory=list)
    # The step's requests in the batch's order (decodes first): an MTP drafter's rows.
    items: list[ScheduledRequest] = field(default_factory=list)
    # Positions whose logits score prompt tokens (prompt_logprobs), in logits_indices
    # after the sampled rows; None when no request asks this step.
    prompt: PromptRows | None = None

    def num_positions(self) -> list[int]:
        """Per request that samples, its rows of logits: its last token's, and each draft's."""
        return [1 + len(d) for d in self.drafts]


@dataclass
class PreparedStep:
    """A step's inputs, built on the host: all that the forward pass and the
    sampler read, so that they can run on another thread or stream."""

    batch: ModelInput
    fast: bool  # run by the runner's DecodeFastPath (decodes only; fast_path.py)
    attn_metadata: Any  # what the backend's build_metadata built; None if the path builds its own
    sampling: SamplingMetadata
    future_slots: torch.Tensor | None = None  # async scheduling: see async_model_runner.py
    drafts: DraftCheck | None = None  # None when no request carries drafts


@dataclass
class FlatBatch:
    """The step's requests end to end, on the host (flatten)."""

    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # where each new token's K and V go
    query_lens: list[int] = field(default_factory=list)
    context_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)  # the requests that sample


@dataclass
class CachedRequestState:
    """What the runner keeps for a request between its steps."""

    sampling_params: SamplingParams
    seed: int
    num_prompt_tokens: int  # a sampled token's output position is its position less these
    prompt_token_ids: list[int]  # for a proposer in the runner (drafting.py)
    prompt_mask: torch.Tensor | None = None  # its prompt's tokens, for a repetition penalty
    prompt_logprobs: PromptLogprobs | None = None  # its list, while it fills


class InputBatch:
    """The requests the runner holds, and the batch of each step."""

    def __init__(
        self, pool: KVCachePool, device: torch.device, vocab_size: int, reads_block_holes: bool
    ) -> None:
        """``reads_block_holes``: the model reads its block tables by position,
        a window's holes and all (DeepSeek-V4)."""
        self.pool, self.block_size, self.device = pool, pool.block_size, device
        self.vocab_size = vocab_size
        self.reads_block_holes = reads_block_holes
        self.requests: dict[str, CachedRequestState] = {}
        # The requests whose prompt logprobs are not yet sent: while there are none,
        # a step computes logits for its sampled rows alone.
        self.pending_prompt_logprobs: dict[str, PromptLogprobs] = {}

    def update_states(self, out: SchedulerOutput) -> None:
        """Forget the requests that ended; keep what new ones need for sampling."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)  # an abort may come before its first step
            self.pending_prompt_logprobs.pop(req_id, None)
        for new in out.new_requests:
            self.requests[new.req_id] = self._new_state(new)

    def _new_state(self, new: NewRequestData) -> CachedRequestState:
        params, ids = new.sampling_params, new.prompt_token_ids
        state = CachedRequestState(params, new.seed, new.num_prompt_tokens, ids)
        if params.repetition_penalty != 1.0:
            state.prompt_mask = prompt_mask(ids, self.vocab_size, self.device)
        if (k := params.prompt_logprobs) is not None:
            state.prompt_logprobs = PromptLogprobs.empty(ids, min(k, self.vocab_size), self.device)
            self.pending_prompt_logprobs[new.req_id] = state.prompt_logprobs
        return state

    def build(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled requests into one batch, decodes first (flatten),
        with the attention metadata and the rows whose logits are needed."""
        q = decode_query_len(max((item.num_drafts for item in out.scheduled), default=0))
        items, num_decodes = decodes_first(out.scheduled, q)
        flat = flatten(items, self.block_size)
        if self.reads_block_holes:  # by position, holes and all (DeepSeek-V4)
            flat.tables, flat.context_lens = tables_with_holes(items)
        prompt = self._prompt_rows(items)
        if prompt is not None:  # logits for them too, after the sampled rows
            flat.logits_indices += prompt.rows
        self.pool.touch(max(flat.slots) // self.block_size + 1)  # new blocks zeroed before use
        sampling = [item for item in items if item.samples]
        return ModelInput(
            self._tensor(flat.input_ids, torch.int64),
            self._tensor(flat.positions, torch.int64),
            self._metadata(flat, items, q, num_decodes),
            self._tensor(flat.logits_indices, torch.int64),
            flat.req_ids,
            [self._first_output(item) for item in sampling],
            [item.draft_token_ids for item in sampling],
            [item.output_token_ids for item in sampling],
            items,
            prompt,
        )

    def _metadata(
        self, flat: FlatBatch, items: list[ScheduledRequest], q: int, num_decodes: int
    ) -> AttentionMetadata:
        """What attention reads of the step, on the device; ``items`` hold their
        ``num_decodes`` decodes first."""
        cu_seqlens = [0]
        for n in flat.query_lens:
            cu_seqlens.append(cu_seqlens[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(flat.slots, torch.int64),
            block_tables=self._tensor(padded(flat.tables), torch.int32),
            context_lens=self._tensor(flat.context_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            num_decodes=num_decodes if q == 1 else 0,  # see AttentionMetadata.num_decodes
            context_lens_cpu=flat.context_lens,
            query_lens_cpu=flat.query_lens,
            decode_query_len=q,
        )
        groups = max((len(item.block_tables) for item in items), default=1)
        if groups > 1:  # the other KV-cache groups' tables (config/cache_groups.py)
            others = [padded([item.block_tables[g] for item in items]) for g in range(1, groups)]
            self.pool.touch(max((b for t in others for row in t for b in row), default=-1) + 1)
            meta.group_tables = (meta.block_tables, *(self._tensor(t, torch.int32) for t in others))
        return meta

    def _prompt_rows(self, items: list[ScheduledRequest]) -> PromptRows | None:
        """The step's rows that score prompt tokens (prompt_logprobs.py); None at
        once while no request waits for its list."""
        if not self.pending_prompt_logprobs:
            return None
        prompt = prompt_rows(items, self.pending_prompt_logprobs)
        for req_id in prompt.due if prompt is not None else ():
            del self.pending_prompt_logprobs[req_id]  # sent with this step's token
        return prompt

    def _first_output(self, item: ScheduledRequest) -> int:
        """The output position of the token sampled after the item's last real token."""
        end = item.num_computed_tokens + item.num_new_tokens - item.num_drafts
        return end - self.requests[item.req_id].num_prompt_tokens

    def sampling_rows(self, batch: ModelInput) -> list[SamplingRow]:
        """A row per sampled position: its request's settings and random stream, its
        output position, and for penalties the output before it (drafts included)."""
        rows = []
        for req_id, first, drafts, output in zip(
            batch.req_ids, batch.first_outputs, batch.drafts, batch.output_token_ids
        ):
            s = self.requests[req_id]
            for j in range(1 + len(drafts)):
                before = None if output is None else output + drafts[:j]
                rows.append(
                    SamplingRow(s.sampling_params, s.seed, first + j, before, s.prompt_mask)
                )
        return rows

    def grammar_mask(self, grammar: GrammarOutput | None, batch: ModelInput) -> GrammarMask | None:
        """The step's grammar masks, on the device, with the rows they belong to:
        a request's first mask is for its first sampled row, each next one for
        the row after (its drafts' positions, in order)."""
        if grammar is None:
            return None
        starts = [0]
        for n in batch.num_positions():
            starts.append(starts[-1] + n)
        row = dict(zip(batch.req_ids, starts))
        rows = self._tensor(grammar_rows(grammar.req_ids, row), torch.int64)
        return GrammarMask(rows, grammar.bitmask.to(self.device, non_blocking=True))

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)


def flatten(items: list[ScheduledRequest], bs: int) -> FlatBatch:
    """The scheduled requests end to end. For every new token: its id, its
    position in its own sequence, and the cache slot where its key and value
    will be written. For every sequence: its block table, its context length,
    and how many queries it has; for each that samples, the rows whose hidden
    states give its tokens.

    Under a kv_window, attention gets the blocks the sequence still holds, in
    order, and the tokens they hold as its context (kept_blocks), while the new
    tokens keep their real positions, for their slots and for RoPE. Every block
    given back lies before every query, so causal masking over the kept tokens
    still holds: a query attends to every kept token up to itself."""
    flat = FlatBatch()
    for item in items:
        start = item.num_computed_tokens
        end = start + item.num_new_tokens
        flat.input_ids += item.token_ids
        flat.positions += range(start, end)
        flat.slots += [item.block_table[p // bs] * bs + p % bs for p in range(start, end)]
        flat.query_lens.append(item.num_new_tokens)
        table, context = kept_blocks(item.block_table, end, bs)  # end, without a window
        flat.tables.append(table)
        flat.context_lens.append(context)
        if item.samples:  # the last token's hidden state, and each draft's, give a token
            last = len(flat.input_ids)
            flat.logits_indices += range(last - 1 - item.num_drafts, last)
            flat.req_ids.append(item.req_id)
    return flat


def tables_with_holes(items: list[ScheduledRequest]) -> tuple[list[list[int]], list[int]]:
    """Each sequence's whole block table, a window's holes (HOLE, -1) left where they
    are, and its real length once the step is done."""
    ends = [item.num_computed_tokens + item.num_new_tokens for item in items]
    return [list(item.block_table) for item in items], ends


def kept_blocks(block_table: list[int], end: int, block_size: int) -> tuple[list[int], int]:
    """What attention reads of a sequence whose cache will hold ``end`` tokens:
    its blocks without a kv_window's holes, and how many tokens they hold (each
    hole was a whole block, before every new token)."""
    if HOLE not in block_table:
        return block_table, end
    kept = [b for b in block_table if b != HOLE]
    return kept, end - (len(block_table) - len(kept)) * block_size


def grammar_rows(req_ids: list[str], first_row: dict[str, int]) -> list[int]:
    """The sampled row of each mask: a request's k-th mask is for the k-th row
    after its first."""
    seen: dict[str, int] = {}
    rows = []
    for req_id in req_ids:
        seen[req_id] = seen.get(req_id, -1) + 1
        rows.append(first_row[req_id] + seen[req_id])
    return rows


def decodes_first(
    scheduled: list[ScheduledRequest], query_len: int
) -> tuple[list[ScheduledRequest], int]:
    """The step's requests with its decodes first, each group in the scheduler's
    order, and how many decode."""
    decodes, rest = [], []
    for item in scheduled:
        (decodes if is_decode(item, query_len) else rest).append(item)
    return decodes + rest, len(decodes)


def is_decode(item: ScheduledRequest, query_len: int) -> bool:
    """Is the item one of the step's decodes, whose query is ``query_len`` tokens:
    its newest token, then the drafts that make up the rest?"""
    return item.num_new_tokens == query_len == decode_query_len(item.num_drafts)
