"""One-step-ahead scheduling, the model runner's half: build a step's inputs on
the engine's thread, and leave its forward pass running while the engine goes on.

execute_model_async prepares a step on the calling thread and launches the rest
of it, the forward pass and sampling:

- on a GPU, on the current CUDA stream. The kernels queue behind the step before,
  the sampled ids are copied to pinned host memory without waiting, and an event
  marks when they have arrived (AsyncCUDAOutput);
- on a CPU, on a single worker thread. torch releases the GIL inside its ops, so
  the engine's thread really does schedule while the forward runs. That worker
  does all of the runner's work, its loading and input building too: a second
  thread running torch operators slows every forward pass (torch_thread.py).

Either way the steps run one at a time, in the order they were launched. That is
what lets a step read, on the device, the tokens the step before it sampled
(future_tokens.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.outputs import LogprobsTensors, ModelRunnerOutput
from engine.runner.future_tokens import FutureTokens
from engine.runner.input_batch import PreparedStep
from engine.runner.model_runner import ModelRunner
from engine.runner.torch_thread import TorchThread
from engine.scheduler_output import PLACEHOLDER, SchedulerOutput
from engine.stats import EngineStats
from engine.utils import to_device


class StepFuture(Protocol):
    """A launched step: result() waits until its output is on the host."""

    def result(self) -> ModelRunnerOutput: ...


class AsyncModelRunner(ModelRunner):
    def __init__(
        self,
        config: EngineConfig,
        stats: EngineStats | None = None,
        worker: TorchThread | None = None,
    ) -> None:
        """``worker``: on a CPU, the thread this runner is built on and called on
        (UniProcExecutor makes it), where each step's forward pass queues too."""
        super().__init__(config, stats)
        self.future = FutureTokens(config.max_num_seqs, self.device)
        if self.device.type == "cpu" and worker is None:
            raise ValueError("on a CPU, AsyncModelRunner runs on a TorchThread it is given")
        self.worker = worker if self.device.type == "cpu" else None

    # --8<-- [start:launch]
    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Prepare the step here; leave its forward pass and sampling running."""
        step = self.prepare_inputs(scheduler_output)
        if self.worker is not None:  # CPU: queued on the worker, which runs this call too
            return self.worker.submit(self.execute_prepared, step)
        return AsyncCUDAOutput(self.execute_prepared(step))  # GPU: queued on the stream

    # --8<-- [end:launch]

    # --8<-- [start:future_refs]
    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The step's inputs, with each placeholder made a reference to a slot,
        and the slot each sampled token will go to."""
        out = scheduler_output
        for req_id in out.preempted_req_ids + out.finished_req_ids:
            self.future.release(req_id)
        step = super().prepare_inputs(replace(out, scheduled=self._refer(out)))
        slots = [self.future.slot(req_id) for req_id in step.batch.req_ids]
        step.future_slots = to_device(slots, torch.int64, self.device)
        return step

    def _refer(self, out: SchedulerOutput) -> list:
        """Each scheduled request, its placeholder replaced by its slot's reference."""
        items = []
        for item in out.scheduled:
            if PLACEHOLDER in item.token_ids:  # the token its last step sampled
                ref = self.future.reference(self.future.slots[item.req_id])
                ids = [ref if t == PLACEHOLDER else t for t in item.token_ids]
                output = item.output_token_ids  # the same token ends it, for penalties
                if output is not None:
                    output = [ref if t == PLACEHOLDER else t for t in output]
                item = replace(item, token_ids=ids, output_token_ids=output)
            items.append(item)
        return items

    @torch.inference_mode()
    def execute_prepared(self, step: PreparedStep) -> ModelRunnerOutput:
        """Resolve the references before the embedding; store the new tokens after
        sampling. The step before has stored its tokens by then: steps run in order."""
        step.batch.input_ids = self.future.resolve(step.batch.input_ids)
        if (penalties := step.sampling.penalties) is not None:  # their tokens too
            penalties.output_token_ids = self.future.resolve(penalties.output_token_ids)
        output = super().execute_prepared(step)
        self.future.store(step.future_slots, output.sampled_token_ids)
        return output

    # --8<-- [end:future_refs]


class AsyncCUDAOutput:
    """A step's output on its way to the host. The copies queue on the stream
    behind the step's kernels, into pinned memory, so queueing them does not
    wait; an event marks when they have landed, and result() waits for it alone."""

    def __init__(self, output: ModelRunnerOutput) -> None:
        lp, accepted = output.logprobs, output.num_accepted
        self.output = replace(
            output,
            sampled_token_ids=pinned_copy(output.sampled_token_ids),
            logprobs=lp and LogprobsTensors(pinned_copy(lp.token_ids), pinned_copy(lp.logprobs)),
            num_accepted=None if accepted is None else pinned_copy(accepted),
        )
        self.ready = torch.cuda.Event()
        self.ready.record()

    def result(self) -> ModelRunnerOutput:
        self.ready.synchronize()
        return self.output


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A host copy of a device tensor, queued on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
