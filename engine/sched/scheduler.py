"""Continuous batching: every step, decide which sequences run and on how many
tokens, within a token budget and the cache's free blocks; after the forward
pass, fold the sampled tokens in and finish the requests that are done.

There is no separate prefill phase. A sequence simply has tokens whose keys and
values are not yet in the cache; a new prompt has many, a decoding sequence has
one (the token it sampled last step). A long prompt is split across steps
(chunked prefill), and its chunks share steps with other sequences' decodes.

A decoding sequence may also carry drafts, the guesses of the tokens after its
newest one that the model runner's proposer made in the step before
(runner/drafting.py): the step computes them too, and the sequence keeps those
the model agrees with, plus the token it samples after the last of them
(update_from_output).

A connector (kv/connector.py) may hold some of a request's blocks outside the
engine: the scheduler counts them as computed once they are loaded, and keeps a
finished request's blocks while the connector saves them (connector_hook.py).

With a sliding window (EngineConfig.kv_window), each time a request is scheduled
it first gives back the blocks its window no longer covers (_slide).
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Collection, Mapping

from engine.kv.block_manager import BlockManager
from engine.kv.connector import KVConnector
from engine.outputs import (
    EngineCoreEventType,
    FinishReason,
)
from engine.sched.accounting import EventLog, count_step
from engine.sched.connector_hook import ConnectorHook, hand_on
from engine.sched.drafts import cut_drafts, proposed
from engine.sched.fold import OutputFold
from engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.proposer import NO_DRAFT, Draft
from engine.spec_decode.verify_length import ConfidenceSchedule
from engine.stats import EngineStats


class Scheduler(OutputFold):
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        stats: EngineStats,
        eos_token_ids: Collection[int] = (),
        max_model_len: int | None = None,
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
        self.verify_schedule = verify_schedule  # None: verify every draft (a fixed k)
        self.kv = ConnectorHook(connector, block_manager.block_size)  # loads and saves
        self.kv_window = kv_window  # (sinks, window); None: a request keeps every block
        self.requests: dict[str, Sequence] = {}  # every unfinished one, by request id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order, oldest first
        self.finished_req_ids: list[str] = []  # since the last step, for the model runner
        self._unsent = SchedulerOutput()  # what an output that ran no step could not say
        self.events = EventLog(stats)

    def add(self, seq: Sequence) -> None:
        if self.kv.holds(seq.request_id):
            raise ValueError(f"request id {seq.request_id!r} still holds blocks of a connector")
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        self.events.record(seq, EngineCoreEventType.QUEUED)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.kv.loading)

    def schedule(self) -> SchedulerOutput:
        """One step's decision: the running sequences' next tokens, then new ones."""
        self.kv_loaded(self.kv.connector.finished_loads())  # their blocks are filled: run them
        out, self.finished_req_ids = SchedulerOutput(finished_req_ids=self.finished_req_ids), []
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        self._schedule_waiting(out, budget)
        self._unsent = hand_on(out, self._unsent)  # an output that runs no step says nothing
        count_step(self.stats, out, self.requests)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running sequences first, oldest first: a decode token (and its drafts),
        or the next chunk of a prompt. If the cache is full, the newest give way.
        Returns the budget left."""
        proposed = self._propose(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self._num_new_tokens(seq), budget)
            if n == 0:  # its last token is still being computed (async_scheduler.py)
                i += 1
                continue
            drafts = proposed.get(seq.request_id, NO_DRAFT)
            drafts = cut_drafts(seq, n, budget, drafts, self.max_model_len, self.stats.spec_decode)
            if not self._reserve(seq, n + len(drafts), out):
                break  # seq was the newest left, and preempted itself
            self._publish(seq, n)
            out.scheduled.append(self._scheduled(seq, n, drafts))
            budget -= n + len(drafts)
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Then admit waiting sequences in arrival order, while budget and blocks
        last. After a preemption the cache is full: admit nobody."""
        while (
            self.waiting
            and budget > 0
            and not out.preempted_req_ids
            and len(self.running) + len(self.kv.loading) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            scheduled = self._admit(seq, budget, out)
            if scheduled is None and seq.status is SequenceStatus.WAITING:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()  # admitted: to run, or to wait for its KV (ConnectorHook)
            if scheduled is not None:
                out.scheduled.append(scheduled)
                budget -= scheduled.num_new_tokens

    def _num_new_tokens(self, seq: Sequence) -> int:
        """The tokens of a running sequence whose keys and values are not in the cache."""
        return seq.num_tokens - seq.num_computed_tokens

    def _propose(self, budget: int) -> dict[str, Draft]:
        """The drafts of the sequences about to decode, cut to the verify schedule's lengths."""
        return proposed(self.running, self._num_new_tokens, self.verify_schedule, budget)

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        """Start (or resume) a waiting sequence, reusing any cached prefix blocks,
        and the blocks after them that a connector holds (kv/connector.py). None
        if it cannot start, or if those blocks load in the background: then it
        holds its blocks in WAITING_FOR_KV, scheduled for nothing (_load)."""
        bm = self.block_manager
        hits = self._prefix_hits(seq)
        num_cached = len(hits) * bm.block_size
        num_external, load_async = self.kv.num_external_tokens(seq, num_cached)
        n = 0 if load_async else min(seq.num_tokens - num_cached - num_external, budget)
        if not bm.can_admit(hits, num_cached + num_external + n):
            return None
        bm.take_cached(seq, hits)
        self._slide(seq)  # hits its window no longer covers go back at once
        bm.allocate(seq, num_cached + num_external + n)  # cannot fail: can_admit checked it
        self.kv.load(seq, num_external, load_async)
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
        self.events.record(seq, EngineCoreEventType.SCHEDULED, num_cached)

    def kv_loaded(self, req_ids: Collection[str] | Mapping[str, int]) -> None:
        """The connector's loads for these requests are done (a mapping: the
        tokens each loaded, if fewer than offered). Each counts its loaded
        tokens as computed, offers its full prompt blocks to the prefix cache,
        and runs from the next step on, as a request whose prefix was cached
        would. One that finished while loading frees its blocks now."""
        for seq, num_loaded in self.kv.loaded(req_ids):
            if seq.is_finished:
                self._release(seq)
                continue
            seq.num_computed_tokens = num_loaded
            self._publish(seq, 0)
            self._start_running(seq, num_loaded)

    def finish_saving(self, req_ids: Collection[str]) -> None:
        """The connector has saved these finished requests' blocks: free them."""
        for seq in self.kv.saved(req_ids):
            self._release(seq)

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
            tuple(seq.block_tables),
            samples=samples,
            draft_token_ids=drafts.token_ids,
            output_token_ids=seq.output_token_ids if samples and seq.params.has_penalties else None,
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
        has computed (BlockManager.free_outside_window; Chapter 6 shows what a
        query then sees, which depends on how its tokens were scheduled)."""
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
        self.events.record(seq, EngineCoreEventType.PREEMPTED)

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
        self.kv.finished(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq)
        del self.requests[seq.request_id]
        self.finished_req_ids.append(seq.request_id)
        unsent = self._unsent.new_requests  # never told to the runner: no need now
        self._unsent.new_requests = [new for new in unsent if new.req_id != seq.request_id]
        self.stats.finished_requests += reason != FinishReason.ABORT

    def _release(self, seq: Sequence) -> None:
        """Free a finished request's blocks once no connector uses them: no load
        still writing them (kv_loaded), no save still reading them (finish_saving)."""
        if not self.kv.holds(seq.request_id):
            self.block_manager.free(seq)
