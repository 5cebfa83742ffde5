"""Continuous batching: every step, decide which sequences run and on how many
tokens, within a token budget and the cache's free blocks; after the forward
pass, fold the sampled tokens in and finish the requests that are done.

There is no separate prefill phase. A sequence simply has tokens whose keys and
values are not yet in the cache; a new prompt has many, a decoding sequence has
one (the token it sampled last step). A long prompt is split across steps
(chunked prefill), and its chunks share steps with other sequences' decodes.

A decoding sequence may also carry drafts, a proposer's guesses of the tokens
after its newest one (DraftProposer): the step computes them too, and the
sequence keeps those the model agrees with, plus the token it samples after
the last of them (update_from_output).

A connector (kv/connector.py) may hold some of a request's blocks outside the
engine: the scheduler counts them as computed once they are loaded, and keeps a
finished request's blocks while the connector saves them.

With a sliding window (EngineConfig.kv_window), each time a request is scheduled
it first gives back the blocks its window no longer covers (_slide).
"""

from __future__ import annotations

import time
from bisect import insort
from collections import deque
from collections.abc import Collection, Mapping
from itertools import count

from engine.attention.metadata import decode_query_len
from engine.kv.block_manager import BlockManager
from engine.kv.connector import KVConnector, NoConnector
from engine.outputs import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    TokenRow,
)
from engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.proposer import NO_DRAFT, Draft, DraftProposer
from engine.spec_decode.verify_length import ConfidenceSchedule, StepShape
from engine.stats import EngineStats


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        stats: EngineStats,
        eos_token_ids: Collection[int] = (),
        max_model_len: int | None = None,
        proposer: DraftProposer | None = None,
        connector: KVConnector | None = None,
        verify_schedule: ConfidenceSchedule | None = None,
        kv_window: tuple[int, int] | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.stats = stats
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.proposer: DraftProposer | None = proposer  # None: no drafts (Chapter 5's)
        self.verify_schedule = verify_schedule  # None: verify every draft (a fixed k)
        self.connector: KVConnector = connector or NoConnector()
        self.kv_window = kv_window  # (sinks, window); None: a request keeps every block
        self.requests: dict[str, Sequence] = {}  # every unfinished one, by request id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order, oldest first
        self.finished_req_ids: list[str] = []  # since the last step, for the model runner
        # Blocks an outside source fills or reads (kv/connector.py), by request id:
        # loads in flight (with the tokens computed once they are done), and the
        # finished requests whose blocks the connector is still saving.
        self.loading: dict[str, tuple[Sequence, int]] = {}
        self.saving: dict[str, Sequence] = {}
        self._unsent = SchedulerOutput()  # what an output that ran no step could not say
        self._event_index = count()

    def add(self, seq: Sequence) -> None:
        if seq.request_id in self.loading or seq.request_id in self.saving:
            raise ValueError(f"request id {seq.request_id!r} still holds blocks of a connector")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        self._record(seq, EngineCoreEventType.QUEUED)

    def _record(self, seq: Sequence, kind: EngineCoreEventType, num_cached: int = 0) -> None:
        """Note what happened to ``seq``, in this step, after everything noted before."""
        step = self.stats.steps + 1  # the step being scheduled (counted once it is)
        index, now = next(self._event_index), time.perf_counter()
        seq.events.append(EngineCoreEvent(index, kind, step, seq.num_tokens, now, num_cached))

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self) -> SchedulerOutput:
        self.kv_loaded(self.connector.finished_loads())  # their blocks are filled: run them
        out, self.finished_req_ids = SchedulerOutput(finished_req_ids=self.finished_req_ids), []
        budget = self.max_num_batched_tokens
        proposed = self._propose(budget)
        # Running sequences first, oldest first: a decode token (and its drafts),
        # or the next chunk of a prompt. If the cache is full, the newest give way.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self._num_new_tokens(seq), budget)
            if n == 0:  # its last token is still being computed (async_scheduler.py)
                i += 1
                continue
            drafts = self._drafts(seq, n, budget, proposed.get(seq.request_id, NO_DRAFT))
            if not self._reserve(seq, n + len(drafts), out):
                break  # seq was the newest left, and preempted itself
            self._publish(seq, n)
            out.scheduled.append(self._scheduled(seq, n, drafts))
            budget -= n + len(drafts)
            i += 1
        # Then admit waiting sequences in arrival order, while budget and blocks
        # last. After a preemption the cache is full: admit nobody.
        while (
            self.waiting
            and budget > 0
            and not out.preempted_req_ids
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            scheduled = self._admit(seq, budget, out)
            if scheduled is None and seq.status is SequenceStatus.WAITING:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()  # admitted: to run, or to wait for its KV (_load)
            if scheduled is not None:
                out.scheduled.append(scheduled)
                budget -= scheduled.num_new_tokens
        self._hand_on(out)
        self._count(out)
        return out

    def _num_new_tokens(self, seq: Sequence) -> int:
        """The tokens of a running sequence whose keys and values are not in the cache."""
        return seq.num_tokens - seq.num_computed_tokens

    def _propose(self, budget: int) -> dict[str, Draft]:
        """Ask the proposer for drafts for the sequences about to decode, each cut
        to the length the verify schedule gives it, if there is one."""
        if self.proposer is None:
            return {}
        decoding = [s for s in self.running if s.num_output_tokens and self._num_new_tokens(s) == 1]
        proposed = self.proposer.propose(decoding) if decoding else {}
        if self.verify_schedule is not None and proposed:
            proposed = self.verify_schedule.cut(proposed, self._step_shape(budget))
        return proposed

    def _step_shape(self, budget: int) -> StepShape:
        """The step's running sequences before any draft: their tokens within
        the budget, and how many decode (each sure to give a token)."""
        pending = [self._num_new_tokens(seq) for seq in self.running]
        return StepShape(min(sum(pending), budget), sum(1 for n in pending if n == 1))

    def _drafts(self, seq: Sequence, n: int, budget: int, drafts: Draft) -> Draft:
        """The drafts ``seq`` checks this step: only after its newest token, within
        the token budget and the model's length, and no more than would reach
        max_tokens with the token sampled after them. Under a grammar, only the
        drafts it accepts (each verified position then gets its own mask)."""
        if not drafts or seq.num_computed_tokens + n != seq.num_tokens:
            return NO_DRAFT
        if (grammar := seq.structured_output) is not None:
            grammar.catch_up(seq.output_token_ids)
            drafts = drafts.head(grammar.draft_prefix(drafts.token_ids))
        room = min(budget - n, seq.params.max_tokens - seq.num_output_tokens - 1)
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens - 1)
        drafts = drafts.head(max(room, 0))
        self.stats.spec_decode.observe_chosen(len(drafts))
        return drafts

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        """Start (or resume) a waiting sequence, reusing any cached prefix blocks,
        and the blocks after them that a connector holds (kv/connector.py). None
        if it cannot start, or if those blocks load in the background: then it
        holds its blocks in WAITING_FOR_KV, scheduled for nothing (_load)."""
        bm = self.block_manager
        hits = self._prefix_hits(seq)
        num_cached = len(hits) * bm.block_size
        num_external, load_async = self._num_external_tokens(seq, num_cached)
        n = 0 if load_async else min(seq.num_tokens - num_cached - num_external, budget)
        if not bm.can_admit(hits, num_cached + num_external + n):
            return None
        bm.take_cached(seq, hits)
        self._slide(seq)  # hits its window no longer covers go back at once
        bm.allocate(seq, num_cached + num_external + n)  # cannot fail: can_admit checked it
        self._load(seq, num_external, load_async)
        self.stats.prefix_cache_hit_tokens += num_cached
        if seq.num_preemptions == 0:  # its first admission: new to the model runner
            seq.num_cached_prompt_tokens = num_cached + num_external
            new = NewRequestData(
                seq.request_id, seq.params, seq.seed, seq.num_prompt_tokens, seq.prompt_token_ids
            )
            out.new_requests.append(new)
        if load_async:
            return None
        self._publish(seq, n)
        self._start_running(seq, num_cached + num_external)
        return self._scheduled(seq, n)

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """The cached blocks ``seq`` may start from: none if it asks for prompt
        logprobs, since a cached token's logits were never kept (vLLM's rule)."""
        if seq.params.prompt_logprobs is not None:
            return []
        return self.block_manager.match_prefix(seq.token_ids)

    def _start_running(self, seq: Sequence, num_cached: int) -> None:
        """Into ``running``, in arrival order: a sequence that comes back returns
        to its old place, ahead of everything that arrived after it."""
        seq.status = SequenceStatus.RUNNING
        insort(self.running, seq, key=lambda s: s.seq_id)
        self._record(seq, EngineCoreEventType.SCHEDULED, num_cached)

    def _num_external_tokens(self, seq: Sequence, num_cached: int) -> tuple[int, bool]:
        """The connector's tokens for ``seq`` past its ``num_cached`` cached ones,
        checked: whole blocks, short of the last token, which the model must run.
        Nothing for a request that asks for prompt logprobs: the model runs them all."""
        if seq.params.prompt_logprobs is not None:
            return 0, False
        num_external, load_async = self.connector.num_external_tokens(seq, num_cached)
        end = num_cached + num_external
        if (
            num_external < 0
            or num_external % self.block_manager.block_size
            or end >= seq.num_tokens
        ):
            raise ValueError(
                f"the connector offers tokens {num_cached}..{end} of {seq.request_id!r}, "
                f"which has {seq.num_tokens}: whole blocks before the last token only"
            )
        return num_external, load_async and num_external > 0

    def _load(self, seq: Sequence, num_external: int, load_async: bool) -> None:
        """Tell the connector which blocks were allocated for its tokens, so that
        its worker side fills them: before this step's forward pass (the tokens
        count as computed now), or in the background, while ``seq`` waits in
        WAITING_FOR_KV, holding its blocks, until kv_loaded reports them done."""
        if num_external == 0:
            return
        bs = self.block_manager.block_size
        first = seq.num_computed_tokens // bs  # the blocks after the cached ones
        block_ids = seq.block_table[first : first + num_external // bs]
        self.connector.after_allocation(seq, block_ids, num_external)
        if load_async:
            seq.status = SequenceStatus.WAITING_FOR_KV
            self.loading[seq.request_id] = (seq, seq.num_computed_tokens + num_external)
        else:
            seq.num_computed_tokens += num_external

    def kv_loaded(self, req_ids: Collection[str] | Mapping[str, int]) -> None:
        """The connector's loads for these requests are done. Each counts its
        loaded tokens as computed, offers its full prompt blocks to the prefix
        cache, and runs from the next step on, as a request whose prefix was cached
        would. One that finished while loading frees its blocks now (_release).
        A mapping gives the tokens each loaded, when fewer than offered (a block
        that failed its check): the rest are computed."""
        for req_id in req_ids:
            if req_id not in self.loading:
                continue  # not loading, or reported twice
            seq, num_loaded = self.loading.pop(req_id)
            if isinstance(req_ids, Mapping):
                num_loaded = min(num_loaded, seq.num_computed_tokens + req_ids[req_id])
            if seq.is_finished:
                self._release(seq)
                continue
            seq.num_computed_tokens = num_loaded
            self._publish(seq, 0)
            self._start_running(seq, num_loaded)

    def finish_saving(self, req_ids: Collection[str]) -> None:
        """The connector has saved these finished requests' blocks: free them."""
        for req_id in req_ids:
            if (seq := self.saving.pop(req_id, None)) is not None:
                self._release(seq)

    def _hand_on(self, out: SchedulerOutput) -> None:
        """An output that schedules nothing (every request left waits for its
        KV) runs no step, so the model runner never reads it: its new requests
        and its preempted and finished ids go with the next output that does."""
        held = self._unsent
        out.new_requests[:0] = held.new_requests
        out.preempted_req_ids[:0] = held.preempted_req_ids
        out.finished_req_ids[:0] = held.finished_req_ids
        self._unsent = SchedulerOutput()
        if not out.scheduled:
            self._unsent = SchedulerOutput(
                new_requests=out.new_requests,
                preempted_req_ids=out.preempted_req_ids,
                finished_req_ids=out.finished_req_ids,
            )
            out.new_requests, out.preempted_req_ids, out.finished_req_ids = [], [], []

    def _publish(self, seq: Sequence, n: int) -> None:
        """Offer the prompt blocks this step will fill to the prefix cache now, not
        after the step: a prompt admitted later in this same step then shares them
        instead of computing the same prefix again. It may read them in the same
        forward pass because every layer stores the whole batch's keys and values
        before any attention reads the cache. Only prompt tokens: a generated
        token may still be a placeholder (async_scheduler.py)."""
        end = min(seq.num_computed_tokens + n, seq.num_prompt_tokens)
        self.block_manager.cache_full_blocks(seq, end)

    @staticmethod
    def _scheduled(seq: Sequence, n: int, drafts: Draft = NO_DRAFT) -> ScheduledRequest:
        """The next ``n`` tokens of ``seq``, then its drafts, as the model runner reads them."""
        start = seq.num_computed_tokens
        samples = start + n == seq.num_tokens
        return ScheduledRequest(
            seq.request_id,
            seq.token_ids[start : start + n] + drafts.token_ids,
            start,
            seq.block_table,
            samples=samples,
            row_table=seq.row_table,
            draft_token_ids=drafts.token_ids,
            output_token_ids=seq.output_token_ids if samples and seq.params.has_penalties else None,
            draft_probs=drafts.probs,
        )

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for ``n`` more tokens of ``seq``, preempting the newest
        running sequences until they fit. False if ``seq`` itself had to go.
        Blocks its window no longer covers go back first (_slide)."""
        self._slide(seq)
        while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]  # the newest arrival
            self._preempt(victim)
            out.preempted_req_ids.append(victim.request_id)
            if victim is seq:
                return False
        return True

    def _slide(self, seq: Sequence) -> None:
        """With a kv_window of (sinks, window), give back the blocks of ``seq`` that
        hold none of its first ``sinks`` tokens and none of the last ``window`` it
        has computed (BlockManager.free_outside_window). This step's queries then
        attend to every token of the blocks it still holds, and to the step's own
        tokens: the sinks and the window, each rounded out to whole blocks, and for
        a prompt chunk the whole chunk. Which keys a query sees thus depends on how
        its tokens were scheduled: a chunked or recomputed prompt sees more than
        one-token decodes do."""
        if self.kv_window is not None:
            sinks, window = self.kv_window
            self.stats.window_freed_blocks += self.block_manager.free_outside_window(
                seq, sinks, window
            )

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the sequence's cache and queue it again at
        the front. Its tokens are kept, so it resumes where it stopped; blocks that
        are still in the prefix cache when it returns need not be recomputed."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        self.stats.preemptions += 1
        self._record(seq, EngineCoreEventType.PREEMPTED)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """After the forward pass. Every request that sampled gets its row: the
        drafts it accepted, then one more token, cut at a stop. Then its keys and
        values in the cache count as computed, less the rejected drafts', whose
        blocks are freed; only then are its full blocks offered to the prefix
        cache. Requests that stopped finish last, after every block is offered."""
        rows = dict(zip(runner_output.req_ids, runner_output.token_rows()))  # the one wait
        folded: list[tuple[Sequence, TokenRow, int, FinishReason | None]] = []
        for item in scheduler_output.scheduled:
            seq, index = self._fold_target(item)
            row = rows.get(item.req_id)
            if seq.is_finished:  # a late finish (async_scheduler.py): its tokens come too late
                self.stats.discarded_tokens += len(row.token_ids) if row is not None else 0
                continue
            kept, reason = self._place_row(seq, index, row) if row is not None else (0, None)
            self._fold_computed(seq, item, row)
            if row is not None:
                folded.append((seq, row, kept, reason))
        outputs = []
        for seq, row, kept, reason in folded:
            if reason is not None:
                self._finish(seq, reason)
            logprobs = row.logprobs[:kept] if seq.params.logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    seq.request_id,
                    row.token_ids[:kept],
                    logprobs,
                    reason,
                    seq.num_cached_prompt_tokens,
                    seq.events,
                    row.prompt_logprobs,
                )
            )
            seq.events = []  # handed on
            self.stats.generated_tokens += kept
        self._keep_drafts(runner_output)
        return outputs

    def _keep_drafts(self, runner_output: ModelRunnerOutput) -> None:
        """Keep the drafts the model runner made after each unfinished request's
        newest token (spec_decode/runner_drafts.py hands them to the next step)."""
        if runner_output.draft_token_ids is None:
            return
        for req_id, drafts in zip(runner_output.req_ids, runner_output.draft_rows()):
            if (seq := self.requests.get(req_id)) is not None:
                seq.runner_drafts, seq.runner_drafts_at = drafts, seq.num_tokens

    def _fold_target(self, item: ScheduledRequest) -> tuple[Sequence, int]:
        """The sequence a step's item belongs to, and the index its first sampled
        token takes: its end, as the step was over before the next was scheduled."""
        seq = self.requests[item.req_id]
        return seq, seq.num_tokens

    def _place_row(
        self, seq: Sequence, index: int, row: TokenRow
    ) -> tuple[int, FinishReason | None]:
        """Place a row's tokens from ``index`` on, up to the first that stops the
        request: how many it kept, and why it stops (None: it goes on)."""
        for i, token in enumerate(row.token_ids):
            reason = self._place_token(seq, index + i, token)
            if reason is not None:
                return i + 1, reason
        return len(row.token_ids), None

    def _place_token(self, seq: Sequence, index: int, token: int) -> FinishReason | None:
        """Append the token (``index`` is the sequence's end) and judge it."""
        seq.token_ids.append(token)
        if seq.structured_output is not None:
            seq.structured_output.accept(token)
        return self._stop_reason(seq, token)

    def _fold_computed(self, seq: Sequence, item: ScheduledRequest, row: TokenRow | None) -> None:
        """The step's keys and values are in the cache, but a rejected draft's are
        not the sequence's: count them out and free the blocks holding only them,
        before any full block is offered to the prefix cache. A stop inside the
        row leaves accepted drafts after it, which are not the sequence's either."""
        rejected = item.num_drafts - (row.num_accepted if row is not None else 0)
        computed = seq.num_computed_tokens + item.num_new_tokens - rejected
        seq.num_computed_tokens = min(computed, seq.num_tokens)
        if item.num_drafts:
            self.stats.spec_decode.observe(item.num_drafts, item.num_drafts - rejected)
            self.block_manager.free_tail(seq, seq.num_computed_tokens)
        self.block_manager.cache_full_blocks(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> FinishReason | None:
        p = seq.params
        stop_token = (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
        if stop_token and seq.num_output_tokens >= p.min_tokens:  # held back before (vLLM)
            return FinishReason.STOP
        if seq.structured_output is not None and seq.structured_output.is_terminated():
            return FinishReason.STOP  # the grammar is complete
        return FinishReason.LENGTH if self._length_reached(seq) else None

    def _length_reached(self, seq: Sequence) -> bool:
        """Has the sequence as many tokens as it may have: its max_tokens, or the model's?"""
        too_long = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        return seq.num_output_tokens >= seq.params.max_tokens or too_long

    def finish_requests(self, request_ids: Collection[str], reason: FinishReason) -> None:
        """End requests from outside the step: an abort, or a stop string the
        front end found. Ids of requests already finished are ignored."""
        for request_id in request_ids:
            if (seq := self.requests.get(request_id)) is not None:
                self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        """End ``seq``; its blocks are freed unless a connector still uses them."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        if self.connector.request_finished(seq, list(seq.block_table)):
            self.saving[seq.request_id] = seq
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq)
        del self.requests[seq.request_id]
        self.finished_req_ids.append(seq.request_id)
        if self.proposer is not None:
            self.proposer.forget([seq.request_id])  # a draft model's blocks, say
        unsent = self._unsent.new_requests  # never told to the runner: no need now
        self._unsent.new_requests = [new for new in unsent if new.req_id != seq.request_id]
        self.stats.finished_requests += reason != FinishReason.ABORT

    def _release(self, seq: Sequence) -> None:
        """Free a finished request's blocks once no connector uses them: no load
        still writing them (kv_loaded), no save still reading them (finish_saving)."""
        if seq.request_id not in self.loading and seq.request_id not in self.saving:
            self.block_manager.free(seq)

    def _count(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq = self.requests[item.req_id]
            decode = item.num_new_tokens == decode_query_len(item.num_drafts)
            if decode and seq.num_output_tokens > 0 and item.samples:
                self.stats.decode_tokens += item.num_new_tokens
            else:
                self.stats.prefill_tokens += item.num_new_tokens
                self.stats.partial_prefills += not item.samples
        self.stats.steps += bool(out.scheduled)  # a step is a forward pass
