"""One-step-ahead (async) scheduling: the engine schedules step N+1 and builds
its inputs while step N's forward pass runs.

LLM(..., async_scheduling=True) makes LLMEngine.step call AsyncLoop.step. Each
call launches one step and then finishes the one before it:

    schedule N+1, build and launch N+1, wait for N, fold N in, N's outputs

so the host's work for step N+1, and its output processing for step N, happen
while a forward pass runs. The price: step N+1 is scheduled before step N's
tokens are known. The scheduler writes placeholders for them
(async_scheduler.py), the model runner resolves those on the device
(future_tokens.py), and a request that finishes on step N's token wastes the
token that step N+1 computes for it.

A request under a grammar cannot wait for its token on the device: its mask for
step N+1 is built on the host, from step N's token. While one has a token in
flight (AsyncScheduler.must_sync), a call finishes step N first and then
launches step N+1, with its masks, as the synchronous LLMEngine.step does:

    wait for N, fold N in, N's outputs, schedule N+1, masks, launch N+1
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.output_processor import OutputSink
from engine.executor.abstract import Executor
from engine.outputs import FinishReason, RequestOutput
from engine.runner.async_model_runner import StepFuture
from engine.sched.async_scheduler import AsyncScheduler
from engine.scheduler_output import PLACEHOLDER, SchedulerOutput
from engine.sequence import Sequence
from engine.stats import EngineStats
from engine.structured_output import StructuredOutputManager
from engine.structured_output.request import StructuredOutputRequest


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    future: StepFuture  # its output, once the forward pass and sampling are done


class AsyncLoop:
    def __init__(
        self,
        scheduler: AsyncScheduler,
        executor: Executor,
        output_processor: OutputSink,
        stats: EngineStats,
        structured_output: StructuredOutputManager,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.output_processor = output_processor
        self.stats = stats
        self.structured_output = structured_output  # fills the grammar masks
        self.in_flight: InFlightStep | None = None  # launched, not yet folded in
        self.num_syncs = 0  # calls that finished a step before scheduling the next

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = self._step()
        self.stats.step_seconds += time.perf_counter() - start
        return outputs

    # --8<-- [start:async_step]
    def _step(self) -> list[RequestOutput]:
        """Launch step N+1, then finish step N, whose forward ran meanwhile; or,
        if a grammar needs step N's token (must_sync), finish N before N+1."""
        previous, self.in_flight = self.in_flight, None
        synced: list[RequestOutput] | None = None
        if previous is not None and self.scheduler.must_sync():
            synced, previous = self._finish(previous), None  # no overlap for N+1
            self.num_syncs += 1
        scheduler_output = self.scheduler.schedule()  # placeholders for N's tokens
        if scheduler_output.scheduled:  # its inputs are built here, its forward left running
            self._fill_bitmask(scheduler_output)
            future = self.executor.execute_model_async(scheduler_output)
            self.in_flight = InFlightStep(scheduler_output, future)
        elif previous is None and synced is None and not self.scheduler.kv.loading:
            raise RuntimeError("requests are waiting but none could be scheduled")
        if synced is not None:
            return synced
        return self._finish(previous) if previous is not None else []

    def _fill_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """The step's grammar masks, as LLMEngine.step fills them, from each
        grammar request's tokens less the placeholder this step just gave it."""
        requests = self.scheduler.requests
        if all(requests[i.req_id].structured_output is None for i in scheduler_output.scheduled):
            return  # most steps: no grammar, nothing to mask
        holders = {
            item.req_id: settled(requests[item.req_id]) for item in scheduler_output.scheduled
        }
        self.structured_output.fill_bitmask(scheduler_output, holders)

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for a step's tokens if its forward still runs, fold them in, and
        turn them into outputs. A stop string found here is a late finish too."""
        runner_output = step.future.result()
        core_outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(processed.reqs_to_abort, FinishReason.STOP)
        return processed.request_outputs

    # --8<-- [end:async_step]


class SettledTokens:
    """A grammar request as its mask sees it when its step is launched: its
    output tokens without the placeholder for the token that step samples."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.structured_output: StructuredOutputRequest | None = seq.structured_output

    @property
    def output_token_ids(self) -> list[int]:
        tokens = self.seq.output_token_ids
        if tokens and tokens[-1] == PLACEHOLDER:
            tokens = tokens[:-1]
        if PLACEHOLDER in tokens:  # must_sync should have waited for it
            raise RuntimeError(f"request {self.seq.request_id!r}: its grammar's token is in flight")
        return tokens


def settled(seq: Sequence) -> Sequence | SettledTokens:
    """``seq`` itself, unless a grammar reads its tokens (SettledTokens)."""
    return seq if seq.structured_output is None else SettledTokens(seq)
