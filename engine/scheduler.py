"""Continuous batching: every step, decide which sequences run and on how many
tokens, within a token budget and the cache's free blocks.

There is no separate prefill phase. A sequence simply has tokens whose keys and
values are not yet in the cache; a new prompt has many, a decoding sequence has
one (the token it sampled last step). A long prompt is split across steps
(chunked prefill), and its chunks share steps with other sequences' decodes.
"""

from __future__ import annotations

from bisect import insort
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.stats import EngineStats


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens to compute this step, from seq.num_computed_tokens on

    @property
    def samples(self) -> bool:
        """Does this step reach the sequence's last token, so that we sample after it?"""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_manager: BlockManager,
        stats: EngineStats,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.block_manager = block_manager
        self.stats = stats
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order, oldest first

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running sequences first, oldest first: a decode token, or the next chunk
        # of a prompt. If the cache is full, the newest sequences give way.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._reserve(seq, n, out):
                break  # seq was the newest left, and preempted itself
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            i += 1
        # Then admit waiting sequences in arrival order, while budget and blocks
        # last. After a preemption the cache is full: admit nobody.
        while (
            self.waiting
            and budget > 0
            and not out.preempted
            and len(self.running) < self.max_num_seqs
        ):
            scheduled = self._admit(self.waiting[0], budget)
            if scheduled is None:
                break  # first come, first served: nobody overtakes the head
            self.waiting.popleft()
            out.scheduled.append(scheduled)
            budget -= scheduled.num_new_tokens
        self._count(out)
        return out

    def _admit(self, seq: Sequence, budget: int) -> ScheduledSeq | None:
        """Start (or resume) a waiting sequence, reusing any cached prefix blocks."""
        bm = self.block_manager
        hits = bm.match_prefix(seq.token_ids)
        num_cached = len(hits) * bm.block_size
        n = min(seq.num_tokens - num_cached, budget)
        if not bm.can_admit(hits, num_cached + n):
            return None
        bm.take_cached(seq, hits)
        bm.allocate(seq, num_cached + n)  # cannot fail: can_admit checked it
        self.stats.prefix_cache_hit_tokens += num_cached
        seq.status = SequenceStatus.RUNNING
        insort(self.running, seq, key=lambda s: s.seq_id)
        return ScheduledSeq(seq, n)

    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Find blocks for ``n`` more tokens of ``seq``, preempting the newest
        running sequences until they fit. False if ``seq`` itself had to go."""
        while not self.block_manager.allocate(seq, seq.num_computed_tokens + n):
            victim = self.running[-1]  # the newest arrival
            self._preempt(victim)
            out.preempted.append(victim)
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

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens are now in the cache."""
        for item in out.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def abort(self, request_id: str) -> Sequence | None:
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self.block_manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
                    seq.finish_reason = "abort"
                    return seq
        return None

    def _count(self, out: SchedulerOutput) -> None:
        for item in out.scheduled:
            decode = item.num_new_tokens == 1 and item.seq.num_output_tokens > 0 and item.samples
            if decode:
                self.stats.decode_tokens += 1
            else:
                self.stats.prefill_tokens += item.num_new_tokens
                self.stats.partial_prefills += not item.samples
        self.stats.steps += 1
