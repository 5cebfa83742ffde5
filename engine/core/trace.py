"""A step timeline: when each stage of each step ran, and on which thread or
stream.

LLM(..., trace=True) records one; trace="path.json" also writes it there, as a
Chrome trace (Perfetto or chrome://tracing open it), each time generate
returns. The stages are timed from outside: StepTrace wraps the methods that
run them, on this engine's own objects, so no stage knows that it is traced,
and an engine without a trace pays nothing.

The stages, and the methods that run them:

    schedule  Scheduler.schedule
    prepare   ModelRunner.prepare_inputs: the step's inputs, built on the host
    forward   ModelRunner.execute_prepared: the forward pass and sampling
    update    Scheduler.update_from_output (sched/fold.py)
    process   OutputProcessor.process_outputs

A span's lane is "main" for the thread that drives the engine and "worker" for
any other (async scheduling runs the forward on a worker thread on CPU). On a
GPU, a forward also gets a span on the lane "gpu", timed with CUDA events, for
when its kernels ran rather than when they were launched.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.core.output_processor import OutputSink
    from engine.runner.model_runner import ModelRunner
    from engine.sched.scheduler import Scheduler
    from engine.stats import EngineStats

STAGES = ("schedule", "prepare", "forward", "update", "process")


@dataclass(frozen=True)
class Span:
    step: int  # the engine step, counting from 1
    stage: str  # one of STAGES
    lane: str  # "main", "worker" or "gpu"
    start: float  # seconds since the trace began
    end: float


class StepTrace:
    """Times the stages of the objects it is given: it wraps ``scheduler``'s
    schedule and update_from_output, ``runner``'s prepare_inputs and
    execute_prepared, and ``processor``'s process_outputs; a step's number is
    ``stats.steps`` when its schedule returns."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        processor: OutputSink,
        stats: EngineStats,
        path: str | None = None,
    ) -> None:
        self.path = path
        self.origin = time.perf_counter()
        self.main = threading.current_thread()
        self._spans: list[Span] = []
        self._step_of: dict[int, int] = {}  # id of a step's SchedulerOutput or inputs
        self._last_update = 0  # the step whose outputs process_outputs gets next
        self._gpu: list[tuple[int, Any, Any]] = []  # (step, start, end) CUDA events unread
        self._gpu_origin = None
        # (object, method name, what the object itself held there, if anything), for detach
        self._wrapped: list[tuple[Any, str, Any]] = []
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
            self._gpu_origin = (torch.cuda.Event(enable_timing=True), self._now())
            self._gpu_origin[0].record()
        self._attach(scheduler, runner, processor, stats)

    def _attach(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        processor: OutputSink,
        stats: EngineStats,
    ) -> None:
        self._wrap(
            scheduler, "schedule", lambda a, out: out.scheduled and self._mark(out, stats.steps)
        )
        self._wrap(runner, "prepare_inputs", lambda a, step: self._mark(step, self._of(a[0])))
        self._wrap(runner, "execute_prepared", lambda a, _: self._step_of.pop(id(a[0])))
        self._wrap(scheduler, "update_from_output", lambda a, _: self._updated(a[0]))
        self._wrap(processor, "process_outputs", lambda a, _: self._last_update)

    def _wrap(self, obj: Any, name: str, step_of: Callable[[tuple, Any], int | None]) -> None:
        """Replace ``obj.name`` on this object alone with a version that records a
        span; ``step_of(args, result)`` names the step, or is falsy to record
        nothing (an empty schedule is no step)."""
        fn, stage = getattr(obj, name), _STAGE_OF[name]

        def traced(*args: Any) -> Any:
            start = self._now()
            events = self._gpu_events() if stage == "forward" else None
            result = fn(*args)
            step = step_of(args, result)
            if step:
                self._spans.append(Span(step, stage, self._lane(), start, self._now()))
                if events is not None:
                    events[1].record()
                    self._gpu.append((step, *events))
            return result

        self._wrapped.append((obj, name, vars(obj).get(name)))
        setattr(obj, name, traced)

    def detach(self) -> None:
        """Stop recording: each wrapped method is what it was before. The spans stay."""
        for obj, name, own in reversed(self._wrapped):
            if own is None:
                delattr(obj, name)  # the class's method again
            else:
                setattr(obj, name, own)
        self._wrapped = []

    def _mark(self, obj: Any, step: int) -> int:
        """Remember which step ``obj`` (a SchedulerOutput, or its inputs) belongs to."""
        self._step_of[id(obj)] = step
        return step

    def _of(self, scheduler_output: Any) -> int:
        return self._step_of[id(scheduler_output)]

    def _updated(self, scheduler_output: Any) -> int:
        self._last_update = self._step_of.pop(id(scheduler_output))
        return self._last_update

    def _now(self) -> float:
        return time.perf_counter() - self.origin

    def _lane(self) -> str:
        return "main" if threading.current_thread() is self.main else "worker"

    def _gpu_events(self) -> tuple[Any, Any] | None:
        if self._gpu_origin is None:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    @property
    def spans(self) -> list[Span]:
        """Every span so far, in the order they started. On a GPU this waits for
        the kernels already launched, to read their events."""
        if self._gpu:
            torch.cuda.synchronize()
            base, host = self._gpu_origin
            for step, start, end in self._gpu:
                at = [host + base.elapsed_time(e) / 1e3 for e in (start, end)]
                self._spans.append(Span(step, "forward", "gpu", *at))
            self._gpu.clear()
        return sorted(self._spans, key=lambda s: (s.start, s.end))

    def save(self, path: str | Path | None = None) -> None:
        """Write the trace in Chrome's trace event format, times in microseconds."""
        target = path or self.path
        if target is None:
            return
        lanes = {"main": 1, "worker": 2, "gpu": 3}
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
            for lane, tid in lanes.items()
        ]
        for s in self.spans:
            events.append(
                {
                    "name": s.stage,
                    "ph": "X",
                    "pid": 1,
                    "tid": lanes[s.lane],
                    "ts": round(s.start * 1e6, 1),
                    "dur": round((s.end - s.start) * 1e6, 1),
                    "args": {"step": s.step},
                }
            )
        Path(target).write_text(json.dumps({"traceEvents": events}) + "\n")


_STAGE_OF = {
    "schedule": "schedule",
    "prepare_inputs": "prepare",
    "execute_prepared": "forward",
    "update_from_output": "update",
    "process_outputs": "process",
}
