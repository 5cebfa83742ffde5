"""Continuous batching: every step, decide which sequences run and on how many
tokens, within a token budget and the cache's free blocks; after the forward
pass, fold the sampled tokens in and finish the requests that are done.

There is no separate prefill phase. A sequence simply has tokens whose keys and
values are not yet in the cache; a new prompt has many, a decoding sequence has
one (the token it sampled last step). A long prompt is split across steps
(chunked prefill), and its chunks share steps with other sequences' decodes.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Collection
from itertools import count

from engine.core.stats import EngineStats
from engine.kv.block_manager import BlockManager
from engine.outputs import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreOutput,
    ModelRunnerOutput,
)
from engine.sched.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        stats: EngineStats,
        eos_token_ids: Collection[int] = (),
        max_model_len: int | None = None,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.stats = stats
        self.eos_token_ids = set(eos_token_ids)
        self.max_model_len = max_model_len
        self.requests: dict[str, Sequence] = {}  # every unfinished one, by request id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order, oldest first
        self.finished_req_ids: list[str] = []  # since the last step, for the model runner
        self._event_index = count()

    def add(self, seq: Sequence) -> None:
        self.requests[seq.request_id] = seq
        self.waiting.append(seq)
        self._record(seq, EngineCoreEventType.QUEUED)

    def _record(self, seq: Sequence, kind: EngineCoreEventType, num_cached: int = 0) -> None:
        """Note what happened to ``seq``, in this step, after everything noted before."""
        step = self.stats.steps + 1  # the step being scheduled (counted once it is)
        event = EngineCoreEvent(next(self._event_index), kind, step, seq.num_tokens, num_cached)
        seq.events.append(event)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self.finished_req_ids)
        self.finished_req_ids = []
        budget = self.max_num_batched_tokens
        # Running sequences first, oldest first: a decode token, or the next chunk
        # of a prompt. If the cache is full, the newest sequences give way.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self._num_new_tokens(seq), budget)
            if n == 0:  # its last token is still being computed (async_scheduler.py)
                i += 1
                continue
            if not self._reserve(seq, n, out):
                break  # seq was the newest left, and preempted itself
            self._publish(seq, n)
            out.scheduled.append(self._scheduled(seq, n))
            budget -= n
            i += 1
        # Then admit waiting sequences in arrival order, while budget and blocks
        # last. After a preemption the cache is full: admit nobody.
        while (
            self.waiting
            and budget > 0
            and not out.preempted_req_ids
            and len(self.running) < self.max_num_seqs
        ):
            scheduled = self._admit(self.waiting[0], budget, out)
            if scheduled is None:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            out.scheduled.append(scheduled)
            budget -= scheduled.num_new_tokens
        self._count(out)
        return out

    def _num_new_tokens(self, seq: Sequence) -> int:
        """The tokens of a running sequence whose keys and values are not in the cache."""
        return seq.num_tokens - seq.num_computed_tokens

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> ScheduledRequest | None:
        """Start (or resume) a waiting sequence, reusing any cached prefix blocks."""
        bm = self.block_manager
        hits = bm.match_prefix(seq.token_ids)
        num_cached = len(hits) * bm.block_size
        n = min(seq.num_tokens - num_cached, budget)
        if not bm.can_admit(hits, num_cached + n):
            return None
        bm.take_cached(seq, hits)
        bm.allocate(seq, num_cached + n)  # cannot fail: can_admit checked it
        self._publish(seq, n)
        self.stats.prefix_cache_hit_tokens += num_cached
        if seq.num_preemptions == 0:  # its first admission: new to the model runner
            seq.num_cached_prompt_tokens = num_cached
            out.new_requests.append(NewRequestData(seq.request_id, seq.params, seq.seed))
        seq.status = SequenceStatus.RUNNING
        insort(self.running, seq, key=lambda s: s.seq_id)
        self._record(seq, EngineCoreEventType.SCHEDULED, num_cached)
        return self._scheduled(seq, n)

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
    def _scheduled(seq: Sequence, n: int) -> ScheduledRequest:
        """The next ``n`` tokens of ``seq``, as the model runner reads them."""
        start = seq.num_computed_tokens
        return ScheduledRequest(
            seq.request_id,
            seq.token_ids[start : start + n],
            start,
            seq.block_table,
            samples=start + n == seq.num_tokens,
        )

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for ``n`` more tokens of ``seq``, preempting the newest
        running sequences until they fit. False if ``seq`` itself had to go."""
        while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]  # the newest arrival
            self._preempt(victim)
            out.preempted_req_ids.append(victim.request_id)
            if victim is seq:
                return False
        return True

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
        """After the forward pass: the scheduled tokens are now in the cache, and
        every request that sampled gets its token, and finishes if it is done."""
        for item in scheduler_output.scheduled:
            seq = self.requests[item.req_id]
            seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(seq)
        tokens = runner_output.sampled_token_ids.tolist()  # the step's one wait for the device
        outputs = []
        for req_id, token, logprobs in zip(
            runner_output.req_ids, tokens, runner_output.logprobs_lists()
        ):
            seq = self.requests[req_id]
            seq.token_ids.append(token)
            if seq.structured_output is not None:
                seq.structured_output.accept(token)
            reason = self._stop_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
            new_logprobs = [logprobs] if seq.params.logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    req_id, [token], new_logprobs, reason, seq.num_cached_prompt_tokens, seq.events
                )
            )
            seq.events = []  # handed on
        self.stats.generated_tokens += len(outputs)
        return outputs

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.structured_output is not None and seq.structured_output.is_terminated():
            return "stop"  # the grammar is complete
        return "length" if self._length_reached(seq) else None

    def _length_reached(self, seq: Sequence) -> bool:
        """Has the sequence as many tokens as it may have: its max_tokens, or the model's?"""
        too_long = self.max_model_len is not None and seq.num_tokens >= self.max_model_len
        return seq.num_output_tokens >= seq.params.max_tokens or too_long

    def finish_requests(self, request_ids: Collection[str], reason: str) -> None:
        """End requests from outside the step: an abort, or a stop string the
        front end found. Ids of requests already finished are ignored."""
        for request_id in request_ids:
            if (seq := self.requests.get(request_id)) is not None:
                self._finish(seq, reason)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self.requests[seq.request_id]
        self.finished_req_ids.append(seq.request_id)
        self.stats.finished_requests += reason != "abort"

    def _count(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            seq = self.requests[item.req_id]
            decode = item.num_new_tokens == 1 and seq.num_output_tokens > 0 and item.samples
            if decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += item.num_new_tokens
                self.stats.partial_prefills += not item.samples
        self.stats.steps += bool(out.scheduled)  # a step is a forward pass
