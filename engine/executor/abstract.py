"""The door between the engine and its model runners.

One process can run one ModelRunner, and every call goes straight to it
(uniproc_executor.py). Expert parallelism (Chapter 4) runs a model runner per rank,
each in a process of its own: its executor (multiproc_executor.py)
sends the same call to every rank, as nano-vllm's ModelRunner.call and vLLM's
executors do, and nothing above this module changes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from engine.distributed.expert_parallel import ExpertLoad
from engine.distributed.placement import ExpertPlacement
from engine.kv.kv_cache import KVBlocks, KVCacheConfig
from engine.outputs import ModelRunnerOutput
from engine.runner.async_model_runner import StepFuture
from engine.scheduler_output import SchedulerOutput


class Executor(ABC):
    # Called after every step's forward pass, on the engine's side: EPLB's clock.
    after_step: Callable[[], None] | None = None

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank's model runner; their results, rank 0 first."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank. Rank 0 samples, so its output is the step's."""
        output = self.collective_rpc("execute_model", scheduler_output)[0]
        if self.after_step is not None:
            self.after_step()
        return output

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> StepFuture:
        """Start one step and return before it is done (async scheduling): rank 0's
        output, once the step has run, from the future's result()."""
        return self.collective_rpc("execute_model_async", scheduler_output)[0]

    def kv_cache_config(self) -> KVCacheConfig:
        """The cache every rank can hold: the fewest blocks and the shortest length."""
        configs = self.collective_rpc("kv_cache_config")
        return KVCacheConfig(
            min(c.num_blocks for c in configs),
            configs[0].block_size,
            min(c.max_model_len for c in configs),
        )

    def read_kv_blocks(self, block_ids: list[int]) -> KVBlocks:
        """Blocks of rank 0's pool, to the host (one rank: see EngineConfig)."""
        return self.collective_rpc("read_kv_blocks", block_ids)[0]

    def write_kv_blocks(self, block_ids: list[int], data: KVBlocks) -> None:
        """Blocks into every rank's pool, between steps."""
        self.collective_rpc("write_kv_blocks", block_ids, data)

    def measure_step_times(self, sizes: list[int]) -> list[float]:
        """Forward-pass seconds for each token count in ``sizes`` (every rank runs
        them, as a step; rank 0's times)."""
        return self.collective_rpc("measure_step_times", sizes)[0]

    def expert_load(self) -> ExpertLoad | None:
        """The MoE layers' records, summed over ranks (bytes listed by rank)."""
        loads = self.collective_rpc("expert_load")
        return None if loads[0] is None else ExpertLoad.merge(loads)

    def apply_placement(self, placement: ExpertPlacement) -> None:
        """Move every rank to a new placement of the experts, between steps."""
        self.collective_rpc("apply_placement", placement)

    def shutdown(self) -> None:  # noqa: B027 (a no-op unless the executor started workers)
        """Release what the executor started; a no-op in one process."""
