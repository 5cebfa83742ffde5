"""The fold-in half of the scheduler (sched/scheduler.py): after the forward
pass, each request that sampled takes its row of tokens, cut at a stop; its keys
and values count as computed, less a rejected draft's; its full blocks are
offered to the prefix cache; and the requests that stopped finish last.

A mixin, as vLLM composes its model runner of mixins: Scheduler inherits these
methods, and AsyncScheduler overrides where its folding differs
(async_scheduler.py)."""

from __future__ import annotations

from collections.abc import Collection

from engine.kv.block_manager import BlockManager
from engine.outputs import EngineCoreOutput, FinishReason, ModelRunnerOutput, TokenRow
from engine.sched.drafts import keep_drafts
from engine.sched.stopping import stop_reason
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence
from engine.stats import EngineStats


class OutputFold:
    """What the fold reads of the scheduler it is part of."""

    requests: dict[str, Sequence]
    block_manager: BlockManager
    stats: EngineStats
    eos_token_ids: Collection[int]
    max_model_len: int | None

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        raise NotImplementedError  # the scheduler's (Scheduler._finish)

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
        outputs = [self._output(*fold) for fold in folded]
        keep_drafts(self.requests, runner_output)
        return outputs

    def _output(
        self, seq: Sequence, row: TokenRow, kept: int, reason: FinishReason | None
    ) -> EngineCoreOutput:
        """The request's news from this step, for the front end; it finishes first if it stopped."""
        if reason is not None:
            self._finish(seq, reason)
        logprobs = row.logprobs[:kept] if seq.params.logprobs is not None else None
        events, seq.events = seq.events, []  # handed on
        self.stats.generated_tokens += kept
        return EngineCoreOutput(
            seq.request_id,
            row.token_ids[:kept],
            logprobs,
            reason,
            seq.num_cached_prompt_tokens,
            events,
            row.prompt_logprobs,
        )

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
        return stop_reason(seq, token, self.eos_token_ids, self.max_model_len)

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
