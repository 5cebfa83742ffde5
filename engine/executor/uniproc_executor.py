"""The executor of one model runner, in the engine's own process."""

from __future__ import annotations

from typing import Any

import torch

from engine.config import EngineConfig
from engine.executor.abstract import Executor
from engine.runner.async_model_runner import AsyncModelRunner
from engine.runner.model_runner import ModelRunner
from engine.runner.torch_thread import TorchThread
from engine.stats import EngineStats


class UniProcExecutor(Executor):
    """One model runner, in the engine's own process. With async scheduling on a
    CPU it lives on a thread of its own (runner/torch_thread.py), and every call
    goes there, after the step already queued."""

    def __init__(self, config: EngineConfig, stats: EngineStats) -> None:
        self.thread: TorchThread | None = None
        if not config.async_scheduling:
            self.model_runner: ModelRunner = ModelRunner(config, stats)
        elif torch.device(config.device).type != "cpu":
            self.model_runner = AsyncModelRunner(config, stats)
        else:
            self.thread = TorchThread()
            self.model_runner = self.thread.call(AsyncModelRunner, config, stats, self.thread)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        call = getattr(self.model_runner, method)
        return [call(*args) if self.thread is None else self.thread.call(call, *args)]

    def shutdown(self) -> None:
        """Let the runner's thread end, with its OpenMP pool (torch_thread.py)."""
        if self.thread is not None:
            self.thread.shutdown()
