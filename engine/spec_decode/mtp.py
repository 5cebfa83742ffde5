"""DeepSeek's multi-token prediction (MTP) module as a draft proposer.

The module predicts token i+2 from the main model's last hidden state h_i at
position i and token i+1 (DeepSeek-V3's in engine/models/deepseek_v3.py; V4's,
whose h is the last layer's hyper-connection streams, in deepseek_v4.py). Those hidden states
exist only in the model runner, so the module drafts there, after each step's
forward pass, sampling and verification, as vLLM and SGLang run it, and as
every proposer runs here (runner/drafting.py); the drafts reach the scheduler
in ModelRunnerOutput.

The module's attention has a paged cache of its own, in the same pool as the
main layers', read through the same block tables and slots: its row at position
i holds what it computed from (h_i, token i+1). Each step runs the module over
the positions the step computed, each with the token after it: the next input
token, or at a request's sampled positions the token sampled there, which is
each accepted draft, then the token sampled after the last accepted one. Rows
of rejected drafts hold wrong tokens, as the main layers' keys there do, and are
written again when their positions are. The last position of a prompt chunk
that samples nothing waits for its next token: its h is held, and its row is
written in the request's next step. (A prefix-cache hit reads the cached
blocks' rows as they are, and the row at a block's last position was computed
with the token that followed it in the request that computed it: only the
drafts can suffer from it, never the output.)

Draft 1 comes from the module's logits at the request's last accepted position.
For k > 1 the module runs again on its own output state and its last draft, one
position further each time. DeepSeek-V3 ships one module, trained to predict one
token further only: drafts 2 and beyond are a use it was not trained for (vLLM
chains it the same way), and are accepted less often.

Every draft is the argmax of the module's logits, and goes to the scheduler
one-hot (Draft.probs None), for greedy and sampled requests alike, as vLLM's
drafts do by default. The runner then checks it against the very token it draws
without speculation (strict match), so a seeded request's output is its output
without speculation, and stays so although the module's floats change with the
batch. Giving the rejection sampler the module's q would usually accept more
where p is flat (high temperatures), but would make a sampled output depend on
the drafts, and so on the batch."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_cache import KVCachePool
from engine.models.base import CausalLM
from engine.sample.sampler import argmax
from engine.scheduler_output import ScheduledRequest, padded
from engine.utils import cdiv, to_device

HELD = -1  # in SeqRows.hidden_rows: the h held from the request's previous step


def mtp_target(model: CausalLM) -> CausalLM:
    """The target model, as one with an MTP module to draft with."""
    if not model.has_mtp():
        raise ValueError("speculative_config method 'mtp' needs a model with an MTP module")
    return model


@dataclass
class SeqRows:
    """One request's rows of the module in one step, on the host."""

    req_id: str
    block_table: list[int]
    positions: list[int] = field(default_factory=list)
    hidden_rows: list[int] = field(default_factory=list)  # into the step's h, or HELD
    token_rows: list[int] = field(default_factory=list)  # into the step's inputs, then samples
    held: torch.Tensor | None = None  # [1, hidden]: the h of a HELD row
    draft_row: int | None = None  # of these rows, its last real token's (when it samples)

    def add(self, position: int, hidden_row: int, token_row: int) -> None:
        self.positions.append(position)
        self.hidden_rows.append(hidden_row)
        self.token_rows.append(token_row)


@dataclass
class DraftStart:
    """Where a request that sampled starts drafting: the module's row at its last
    real token, that token's position (its accepted drafts follow it), and its
    blocks."""

    row: int
    position: int
    block_table: list[int]


@dataclass
class ModuleBatch:
    """One run of the module over the step's rows, requests of one row first."""

    meta: AttentionMetadata
    positions: list[int]
    hidden_rows: list[int]  # into the step's h, then ``held``
    token_rows: list[int]  # into the step's input ids, then its sampled tokens
    held: list[torch.Tensor]
    starts: list[DraftStart]  # per request that sampled, in the step's order


def paged_metadata(
    positions: list[list[int]], tables: list[list[int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Attention metadata for sequences whose rows sit at consecutive positions
    that end their context; those of one row, which come first, are decodes."""
    bs = block_size
    slots = [t[p // bs] * bs + p % bs for ps, t in zip(positions, tables) for p in ps]
    query_lens = [len(ps) for ps in positions]
    context_lens = [ps[-1] + 1 for ps in positions]
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), len(query_lens))
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        block_tables=to_device(padded(tables), torch.int32, device),
        context_lens=to_device(context_lens, torch.int32, device),
        cu_seqlens_q=to_device(list(accumulate(query_lens, initial=0)), torch.int32, device),
        num_decodes=num_decodes,
        context_lens_cpu=context_lens,
        query_lens_cpu=query_lens,
    )


def module_batch(
    seqs: list[SeqRows], num_hidden: int, block_size: int, device: torch.device
) -> ModuleBatch | None:
    """The step's rows as one batch (None if there are none), the requests of
    one row first, so that they take the backends' decode path."""
    order = sorted((s for s in seqs if s.positions), key=lambda s: len(s.positions) != 1)
    if not order:
        return None
    hidden_rows, token_rows, held, starts, row = [], [], [], {}, 0
    for s in order:
        for h in s.hidden_rows:
            hidden_rows.append(num_hidden + len(held) if h == HELD else h)
            held += [s.held] if h == HELD else []
        token_rows += s.token_rows
        if s.draft_row is not None:
            i = s.draft_row
            starts[s.req_id] = DraftStart(row + i, s.positions[i], s.block_table)
        row += len(s.positions)
    meta = paged_metadata(
        [s.positions for s in order], [s.block_table for s in order], block_size, device
    )
    positions = [p for s in order for p in s.positions]
    in_order = [starts[s.req_id] for s in seqs if s.draft_row is not None]
    return ModuleBatch(meta, positions, hidden_rows, token_rows, held, in_order)


def offsets(items: list[ScheduledRequest]) -> Iterator[tuple[ScheduledRequest, int, int]]:
    """Each request of the step with the index of its first input token and,
    if it samples, of its first sampled token."""
    offset = first = 0
    for item in items:
        yield item, offset, first
        offset += item.num_new_tokens
        first += 1 + item.num_drafts if item.samples else 0


class MTPProposer:
    """The MTP module's drafts for every request that sampled, made in the runner."""

    def __init__(
        self,
        model: CausalLM,
        pool: KVCachePool,
        backend: AttentionBackend,
        k: int,
        max_num_seqs: int,
    ) -> None:
        """``pool`` holds the module's attention layers as well as the main ones'."""
        self.model, self.backend, self.k = model, backend, k
        self.block_size = pool.block_size
        self.max_model_len = pool.max_model_len
        self.device = next(model.parameters()).device
        self.held: dict[str, tuple[int, torch.Tensor]] = {}  # req id: (position, h)
        self.first_scratch = pool.num_blocks
        self.scratch_per_seq = cdiv(k - 1, self.block_size)
        self._add_scratch(pool, max_num_seqs * self.scratch_per_seq)

    def _add_scratch(self, pool: KVCachePool, num_scratch: int) -> None:
        """Blocks past the pool's, in the module's caches alone, which the block
        manager never hands out: the rows of drafts 2 and beyond go there when
        they fall past a request's blocks (a draft's position has none yet)."""
        if num_scratch == 0:
            return
        total = pool.num_blocks + num_scratch
        for layer in self.model.mtp_attention_layers():
            spec = layer.kv_cache_spec(pool.config.dtype)
            layer.kv_cache = None  # free the pool's tensors before the larger ones come
            layer.kv_cache = spec.allocate(total, self.block_size, self.device)
            for t in layer.kv_cache.tensors():  # zeroed as the pool zeroes its own
                t[: pool.num_touched_blocks].zero_()
                t[pool.num_blocks :].zero_()

    def forget(self, req_ids: list[str]) -> None:
        """Requests that finished hold no h any more. A preempted one keeps its h:
        it may resume, from the prefix cache, right after the position it held."""
        for req_id in req_ids:
            self.held.pop(req_id, None)

    @torch.inference_mode()
    def propose(
        self,
        items: list[ScheduledRequest],
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        sampled: torch.Tensor,
        accepted: torch.Tensor | None,
    ) -> torch.Tensor:
        """[requests that sampled, k] drafts, on the device, in the step's order of
        them. ``items``: the step's requests in the batch's order, whose
        ``input_ids`` gave the final ``hidden`` states; ``sampled``: the step's
        tokens; ``accepted``: the drafts each request that sampled accepted (None:
        the step had none)."""
        n = len(input_ids)
        seqs = [self._rows(item, offset, n + first) for item, offset, first in offsets(items)]
        self._hold(items, hidden)
        batch = module_batch(seqs, len(hidden), self.block_size, self.device)
        if batch is None:
            return torch.empty(0, self.k, dtype=torch.int64, device=self.device)
        source = torch.cat([hidden, *batch.held]) if batch.held else hidden
        h = source[self._tensor(batch.hidden_rows)]
        tokens = torch.cat([input_ids, sampled])[self._tensor(batch.token_rows)]
        normed, state = self._run(batch.meta, batch.positions, h, tokens)
        if not batch.starts:  # prompt chunks alone: their rows are written, nobody drafts
            return torch.empty(0, self.k, dtype=torch.int64, device=self.device)
        if accepted is None:
            accepted = torch.zeros(len(batch.starts), dtype=torch.int64, device=self.device)
        last = self._tensor([s.row for s in batch.starts]) + accepted
        drafts = [self._argmax(normed[last])]
        if self.k > 1:  # the one wait for the device: where each request's drafts go
            drafts += self._chain(batch.starts, accepted.tolist(), state[last], drafts[0])
        return torch.stack(drafts, dim=1)

    def _rows(self, item: ScheduledRequest, offset: int, first: int) -> SeqRows:
        """A request's rows: each position the step computed, with the token after
        it (``first``: the row of its first sampled token among the inputs and
        samples), and before them the position whose h it held, if any."""
        start, end = item.num_computed_tokens, item.num_computed_tokens + item.num_new_tokens
        sampled_from = end - 1 - item.num_drafts if item.samples else end
        seq = SeqRows(item.req_id, item.block_table)
        held = self.held.pop(item.req_id, None)
        if held is not None and held[0] == start - 1:  # its next token is this step's first
            seq.add(start - 1, HELD, offset)
            seq.held = held[1]
        for pos in range(start, end):
            row = offset + pos - start
            if pos >= sampled_from:
                seq.add(pos, row, first + pos - sampled_from)
            elif pos + 1 < end:
                seq.add(pos, row, row + 1)
        if item.samples:
            seq.draft_row = len(seq.positions) - 1 - item.num_drafts
        return seq

    def _hold(self, items: list[ScheduledRequest], hidden: torch.Tensor) -> None:
        """Keep the h of each prompt chunk's last position that samples nothing:
        its token comes with the request's next step."""
        for item, offset, _ in offsets(items):
            if not item.samples and item.num_new_tokens:
                last = offset + item.num_new_tokens - 1
                position = item.num_computed_tokens + item.num_new_tokens - 1
                self.held[item.req_id] = (position, hidden[last : last + 1].clone())

    def _chain(
        self,
        starts: list[DraftStart],
        accepted: list[int],
        state: torch.Tensor,
        draft: torch.Tensor,
    ) -> list[torch.Tensor]:
        """Drafts 2..k: the module on its own output state and its last draft, one
        position further each time (beyond what V3's module was trained for)."""
        limit = self.max_model_len - 1  # further drafts would be cut by the scheduler
        first = [s.position + a + 1 for s, a in zip(starts, accepted)]
        tables = [
            self._with_scratch(s.block_table, min(p + self.k - 2, limit), i)
            for i, (s, p) in enumerate(zip(starts, first))
        ]
        drafts = []
        for j in range(self.k - 1):
            positions = [min(p + j, limit) for p in first]
            meta = paged_metadata([[p] for p in positions], tables, self.block_size, self.device)
            normed, state = self._run(meta, positions, state, draft)
            draft = self._argmax(normed)
            drafts.append(draft)
        return drafts

    def _with_scratch(self, table: list[int], last: int, i: int) -> list[int]:
        """Request i's blocks, then scratch blocks up to position ``last``."""
        missing = last // self.block_size + 1 - len(table)
        first = self.first_scratch + i * self.scratch_per_seq
        return table + list(range(first, first + max(missing, 0)))

    def _run(
        self, meta: AttentionMetadata, positions: list[int], h: torch.Tensor, tokens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module over rows of (h, next token) at ``positions``: its normalised
        output and its output before the norm."""
        with forward_context(meta, self.backend.build_metadata(meta), self.backend):
            return self.model.mtp_hidden_states(self._tensor(positions), h, tokens)

    def _argmax(self, normed: torch.Tensor) -> torch.Tensor:
        return argmax(self.model.draft_logits(normed))

    def _tensor(self, data: list[int]) -> torch.Tensor:
        return to_device(data, torch.int64, self.device)
