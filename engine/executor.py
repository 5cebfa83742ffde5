"""The door between the engine and its model runners.

Today one process runs one ModelRunner, and every call goes straight to it.
Expert parallelism (Chapter 4) runs a model runner per GPU, each in a process
of its own: a multiprocess executor will then send the same call to every
rank, as nano-vllm's ModelRunner.call and vLLM's executors do, and nothing
above this module has to change.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from engine.async_model_runner import AsyncModelRunner, StepFuture
from engine.config import EngineConfig
from engine.kv_cache import KVCacheConfig
from engine.model_runner import ModelRunner
from engine.outputs import ModelRunnerOutput
from engine.scheduler_output import SchedulerOutput
from engine.stats import EngineStats


class Executor(ABC):
    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every rank's model runner; their results, rank 0 first."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank. Rank 0 samples, so its output is the step's."""
        return self.collective_rpc("execute_model", scheduler_output)[0]

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


class UniProcExecutor(Executor):
    """One model runner, in the engine's own process."""

    def __init__(self, config: EngineConfig, stats: EngineStats) -> None:
        runner = AsyncModelRunner if config.async_scheduling else ModelRunner
        self.model_runner = runner(config, stats)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.model_runner, method)(*args)]
