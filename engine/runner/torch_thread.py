"""The one thread that does an engine's torch work on a CPU.

PyTorch parallelises a CPU operator with OpenMP, and GNU OpenMP (which the
Linux wheels ship) gives every thread that runs a parallel region a thread pool
of its own, kept for as long as that thread lives. Once the pools together hold
more threads than the machine has CPUs, libgomp's idle threads spin 100 times,
not 300,000, before they sleep, and each parallel operator then wakes them
through the operating system, in every pool, for as long as both pools last.
A decode step of the tiny model on two cores then took twice as long or more,
whichever thread ran it (``python -m engine.tools.overlap_bench``).

So an engine that runs its forward pass on a thread other than the one that
loaded the model must load it there too, and keep every large operator there:
the model runner is built on this thread and every call to it goes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch


class TorchThread:
    """A single worker thread, with as many intra-op threads as its creator has.
    It starts on first use; shutdown() lets it end, and its OpenMP pool with it,
    so that a model run later on another thread does not meet a second pool."""

    def __init__(self, name: str = "forward") -> None:
        self.name = name
        self.threads = torch.get_num_threads()
        self.pool: ThreadPoolExecutor | None = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn`` after everything submitted before it; do not wait."""
        if self.pool is None:  # first use, or first since shutdown(): a new thread
            self.pool = ThreadPoolExecutor(1, self.name, torch.set_num_threads, (self.threads,))
        return self.pool.submit(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn`` on the thread, in turn, and wait for its result."""
        return self.submit(fn, *args).result()

    def shutdown(self) -> None:
        """Let the thread end once what was submitted is done (an engine that is
        shut down, or collected). A later call starts another."""
        if self.pool is not None:
            self.pool.shutdown(wait=False)
            self.pool = None
