"""One-step-ahead scheduling, the scheduler's half: schedule step N+1 before
step N's tokens are known.

With async scheduling (async_loop.py) the engine schedules step N+1 while step
N's forward pass is still running, so the scheduler cannot wait for step N's
tokens. It schedules as if they had arrived. Every request that samples in a
step gets a PLACEHOLDER at the end of its token list, standing for the token
that step will sample, and the step's tokens count as computed at once. To the
rest of the scheduler a placeholder is a token like any other: the next step
schedules it as a decode, and the model runner finds its value on the device
(future_tokens.py). When step N's output arrives, each placeholder becomes its
token, one step later than the scheduler needed it. Each consequence of that
delay is handled where it happens:

- a request that stops on step N's token (EOS, a stop token, or a stop string
  the front end finds) was already scheduled in step N+1: its blocks are freed
  at once, and the token step N+1 computed for it is discarded when it arrives
  (update_from_output);
- a request whose step-N token is its last by length is not scheduled again,
  because max_tokens and the model's length are known before the token is
  (_num_new_tokens);
- a request preempted while its step-N token is in flight keeps that token
  when it arrives, and recomputes the rest as any preempted request does;
- a request under a grammar needs its newest token on the host before its next
  step is built, for the grammar's mask: such a request makes the engine wait
  (must_sync), so it never has a token in flight when it is scheduled.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.outputs import EngineCoreOutput, FinishReason, ModelRunnerOutput, TokenRow
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.stopping import length_reached
from engine.scheduler_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.spec_decode.proposer import NO_DRAFT, Draft


@dataclass
class StepInFlight:
    """A step scheduled and not yet folded in: its requests as they were then, and
    for each, where its new tokens end, which is where its sampled token goes."""

    seqs: dict[str, Sequence] = field(default_factory=dict)
    ends: dict[str, int] = field(default_factory=dict)


def needs_token_on_host(params: SamplingParams) -> bool:
    """Must the host see a request's newest token before its next step is built?

    A request with structured output must: its grammar has to accept token N
    before it can mask the logits for token N+1, and that mask is built on the
    host. While such a request has a token in flight, the engine waits for the
    step in flight before it schedules the next one (AsyncScheduler.must_sync)."""
    return params.structured_outputs is not None


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.in_flight: deque[StepInFlight] = deque()  # oldest first
        self.folding = StepInFlight()  # the step update_from_output is folding in

    # --8<-- [start:schedule_ahead]
    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        step = StepInFlight()
        for item in out.scheduled:
            seq = self.requests[item.req_id]
            seq.num_computed_tokens += item.num_new_tokens  # in flight counts as computed
            # The tokens this step will sample: one per sampling request, as no
            # request carries drafts here (_propose).
            seq.token_ids += [PLACEHOLDER] * item.samples
            step.seqs[item.req_id] = seq
            step.ends[item.req_id] = seq.num_computed_tokens
        if out.scheduled:  # an empty output runs no step (Scheduler._hand_on)
            self.in_flight.append(step)
        return out

    def _num_new_tokens(self, seq: Sequence) -> int:
        if seq.token_ids[-1] == PLACEHOLDER and length_reached(seq, self.max_model_len):
            return 0  # the token in flight is its last: nothing comes after it
        return super()._num_new_tokens(seq)

    # --8<-- [end:schedule_ahead]

    def _propose(self, budget: int) -> dict[str, Draft]:
        """Drafts would have to be checked against tokens still in flight."""
        if any(super()._propose(budget).values()):
            raise ValueError("draft tokens need async_scheduling=False")
        return {}

    @staticmethod
    def _scheduled(seq: Sequence, n: int, drafts: Draft = NO_DRAFT) -> ScheduledRequest:
        item = Scheduler._scheduled(seq, n, drafts)
        # The step runs while the scheduler goes on changing its own lists: the
        # step gets a block table of its own.
        item.block_tables = tuple(list(table) for table in item.block_tables)
        return item

    def must_sync(self) -> bool:
        """Must the step in flight return before the next one is scheduled? Only
        if a running request waits for its newest token on the host."""
        return any(
            seq.token_ids[-1] == PLACEHOLDER and needs_token_on_host(seq.params)
            for seq in self.running
        )

    # --8<-- [start:late_finish]
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Step N's tokens, which arrive after step N+1 was scheduled: each takes
        its placeholder's place, unless its request has finished since (the
        base's loop skips those, and counts their tokens as discarded)."""
        self.folding = self.in_flight.popleft()
        return super().update_from_output(scheduler_output, runner_output)

    def _fold_target(self, item: ScheduledRequest) -> tuple[Sequence, int]:
        """The request as it was scheduled, and where its placeholder stands."""
        return self.folding.seqs[item.req_id], self.folding.ends[item.req_id]

    def _fold_computed(self, seq: Sequence, item: ScheduledRequest, row: TokenRow | None) -> None:
        """Counted as computed when scheduled; offer its full blocks now, unless it
        was preempted since, which freed them."""
        if seq.status is SequenceStatus.RUNNING:
            self.block_manager.cache_full_blocks(seq, self.folding.ends[item.req_id])

    # --8<-- [end:late_finish]

    def _place_token(self, seq: Sequence, index: int, token: int) -> FinishReason | None:
        """Put the token where its placeholder stands, and judge it as the newest
        token: a placeholder after it belongs to a step that has sampled nothing yet.
        A grammar accepts it as the base's does (such a request has none ahead)."""
        ahead = seq.token_ids[index + 1 :]
        del seq.token_ids[index:]
        reason = super()._place_token(seq, index, token)
        if reason is None:
            seq.token_ids += ahead
        return reason
