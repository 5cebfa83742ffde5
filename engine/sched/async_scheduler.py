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
- structured output will need a request's newest token on the host before its
  next step is built: such a request makes the engine wait (must_sync).
"""

from __future__ import annotations

from collections import deque

from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sched.scheduler_output import PLACEHOLDER, ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


def needs_token_on_host(params: SamplingParams) -> bool:
    """Must the host see a request's newest token before its next step is built?

    No request does yet. Structured output will: its grammar has to accept token
    N before it can mask the logits for token N+1, and that mask is built on the
    host. Its requests will answer True here, and the engine then waits for the
    step in flight before it schedules the next one (AsyncScheduler.must_sync)."""
    return False


class AsyncScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # The steps scheduled but not yet folded in, oldest first: for each, its
        # requests as they were then, and where each one's new tokens end.
        self.in_flight: deque[dict[str, tuple[Sequence, int]]] = deque()

    # --8<-- [start:schedule_ahead]
    def schedule(self) -> SchedulerOutput:
        out = super().schedule()
        step = {}
        for item in out.scheduled:
            seq = self.requests[item.req_id]
            seq.num_computed_tokens += item.num_new_tokens  # in flight counts as computed
            if item.samples:
                seq.token_ids.append(PLACEHOLDER)  # the token this step will sample
            step[item.req_id] = (seq, seq.num_computed_tokens)
        if out.scheduled:
            self.in_flight.append(step)
        return out

    def _num_new_tokens(self, seq: Sequence) -> int:
        if seq.token_ids[-1] == PLACEHOLDER and self._length_reached(seq):
            return 0  # the token in flight is its last: nothing comes after it
        return super()._num_new_tokens(seq)

    # --8<-- [end:schedule_ahead]

    @staticmethod
    def _scheduled(seq: Sequence, n: int) -> ScheduledRequest:
        item = Scheduler._scheduled(seq, n)
        # The step runs while the scheduler goes on changing its own lists: the
        # step gets a block table of its own.
        item.block_table = list(item.block_table)
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
        its placeholder's place, unless its request has finished since."""
        step = self.in_flight.popleft()
        for seq, end in step.values():
            if seq.status is SequenceStatus.RUNNING:  # not preempted or finished since
                self.block_manager.cache_full_blocks(seq, end)
        tokens = runner_output.sampled_token_ids.tolist()
        outputs = []
        for req_id, token, logprobs in zip(
            runner_output.req_ids, tokens, runner_output.logprobs_lists()
        ):
            seq, end = step[req_id]
            if seq.is_finished:  # a late finish: it stopped on step N-1's token
                self.stats.discarded_tokens += 1
                continue
            reason = self._place_token(seq, end, token)
            if reason is not None:  # free its blocks now, though step N+1 may write them
                self._finish(seq, reason)
            new_logprobs = [logprobs] if seq.params.logprobs is not None else None
            outputs.append(
                EngineCoreOutput(
                    req_id, [token], new_logprobs, reason, seq.num_cached_prompt_tokens, seq.events
                )
            )
            seq.events = []
        self.stats.generated_tokens += len(outputs)
        return outputs

    # --8<-- [end:late_finish]

    def _place_token(self, seq: Sequence, index: int, token: int) -> str | None:
        """Put the token where its placeholder stands, and judge it as the newest
        token: a placeholder after it belongs to a step that has sampled nothing yet."""
        ahead = seq.token_ids[index + 1 :]
        del seq.token_ids[index:]
        seq.token_ids.append(token)
        reason = self._stop_reason(seq, token)
        if reason is None:
            seq.token_ids += ahead
        return reason
