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
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.core.executor import Executor
from engine.core.output_processor import OutputProcessor
from engine.core.stats import EngineStats
from engine.outputs import FinishReason, RequestOutput
from engine.runner.async_model_runner import StepFuture
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.scheduler_output import SchedulerOutput


@dataclass
class InFlightStep:
    scheduler_output: SchedulerOutput
    future: StepFuture  # its output, once the forward pass and sampling are done


class AsyncLoop:
    def __init__(
        self,
        scheduler: AsyncScheduler,
        executor: Executor,
        output_processor: OutputProcessor,
        stats: EngineStats,
    ) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.output_processor = output_processor
        self.stats = stats
        self.in_flight: InFlightStep | None = None  # launched, not yet folded in

    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = self._step()
        self.stats.step_seconds += time.perf_counter() - start
        return outputs

    # --8<-- [start:async_step]
    def _step(self) -> list[RequestOutput]:
        """Launch step N+1, then finish step N, whose forward ran meanwhile."""
        previous, self.in_flight = self.in_flight, None
        if previous is not None and self.scheduler.must_sync():
            return self._finish(previous)  # no overlap: the next call schedules N+1
        scheduler_output = self.scheduler.schedule()  # placeholders for N's tokens
        if scheduler_output.scheduled:  # its inputs are built here, its forward left running
            future = self.executor.execute_model_async(scheduler_output)
            self.in_flight = InFlightStep(scheduler_output, future)
        elif previous is None:
            raise RuntimeError("requests are waiting but none could be scheduled")
        return self._finish(previous) if previous is not None else []

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        """Wait for a step's tokens if its forward still runs, fold them in, and
        turn them into outputs. A stop string found here is a late finish too."""
        runner_output = step.future.result()
        core_outputs = self.scheduler.update_from_output(step.scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(processed.reqs_to_abort, FinishReason.STOP)
        return processed.request_outputs

    # --8<-- [end:async_step]
