"""Expert parallelism's executor: one model runner per rank, each in a process.

Rank 0 runs in the engine's own process; ranks 1..N-1 are worker processes
started with torch.multiprocessing (spawn). All N join one torch.distributed
group (gloo on the CPU, nccl on GPUs), which the MoE layers' all-to-alls use.
Every call goes to every rank over a pipe, as in vLLM's multiprocess executor.

Lifecycle: workers ignore Ctrl-C (the engine's process handles it, after the
step in flight), die with the engine's process (PR_SET_PDEATHSIG on Linux), and
are shut down by shutdown(), by the executor's finalizer, or at exit. A worker
that dies makes the next call, or the collective waiting on it, raise
WorkerDiedError: within the group's timeout at worst, never a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import signal
import socket
import sys
import traceback
import weakref
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.config import EngineConfig
from engine.executor.abstract import Executor
from engine.runner.model_runner import ModelRunner
from engine.stats import EngineStats

STARTUP_TIMEOUT_S = 600.0  # loading a model in a fresh process: imports, weights
JOIN_TIMEOUT_S = 5.0


class WorkerDiedError(RuntimeError):
    """An expert-parallel worker is gone; the engine cannot run another step."""


@dataclass
class Worker:
    rank: int
    process: Any  # a multiprocessing Process
    conn: Connection


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(config: EngineConfig, rank: int, port: int) -> None:
    """Join the expert-parallel group: gloo on the CPU, nccl on GPUs."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed group already exists in this process")
    backend = "nccl" if torch.device(config.device).type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=config.expert_parallel_size,
        timeout=datetime.timedelta(seconds=config.distributed_timeout_s),
    )


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """On GPUs, rank r runs on cuda:r."""
    if torch.device(config.device).type != "cuda":
        return config
    return replace(config, device=f"cuda:{rank}")


def _die_with_parent() -> None:
    """Linux: the kernel sends this process SIGKILL when its parent dies."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_main(config: EngineConfig, rank: int, port: int, threads: int, conn) -> None:
    """A worker: join the group, build a runner, then serve calls until told to stop
    or until the engine's end of the pipe closes."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the engine's to handle
    torch.set_num_threads(threads)
    try:
        init_group(config, rank, port)
        runner = ModelRunner(rank_config(config, rank), EngineStats(), rank)
        conn.send(("ready", None))
        while True:
            method, args = conn.recv()
            if method == "shutdown":
                break
            conn.send(("ok", getattr(runner, method)(*args)))
    except EOFError:
        pass  # the engine is gone
    except BaseException:
        with contextlib.suppress(OSError):  # the engine may be gone too
            conn.send(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _shutdown(workers: list[Worker]) -> None:
    """Ask each worker to stop; terminate, then kill, any that does not."""
    for w in workers:
        with contextlib.suppress(OSError):  # a dead worker's pipe
            w.conn.send(("shutdown", ()))
    for w in workers:
        w.process.join(JOIN_TIMEOUT_S)
        if w.process.is_alive():
            w.process.terminate()
            w.process.join(JOIN_TIMEOUT_S)
        if w.process.is_alive():
            w.process.kill()
            w.process.join()
        w.conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, stats: EngineStats) -> None:
        self.size = config.expert_parallel_size
        self.timeout_s = config.distributed_timeout_s
        self.failure: str | None = None
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.workers: list[Worker] = []
        for rank in range(1, self.size):
            ours, theirs = ctx.Pipe()
            args = (config, rank, port, torch.get_num_threads(), theirs)
            proc = ctx.Process(target=worker_main, args=args, daemon=True)
            proc.start()
            theirs.close()
            self.workers.append(Worker(rank, proc, ours))
        # del llm, garbage collection or interpreter exit: whichever comes first.
        self._finalizer = weakref.finalize(self, _shutdown, self.workers)
        try:
            init_group(config, 0, port)
            self.model_runner = ModelRunner(rank_config(config, 0), stats, rank=0)
            for w in self.workers:
                self._receive(w, STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Send the call to every worker, run rank 0's share here, then collect."""
        self._check_alive()
        for w in self.workers:
            try:
                w.conn.send((method, args))
            except OSError as e:
                self._fail(f"could not reach rank {w.rank}: {e}")
        try:
            mine = getattr(self.model_runner, method)(*args)
        except (RuntimeError, OSError) as e:  # a collective failed: a rank is gone, or raised
            for w in self.workers:  # its own error says more than the broken collective
                with contextlib.suppress(OSError):
                    if w.conn.poll(1.0):
                        self._receive(w, 0.0)
            self._check_alive(grace_s=1.0)
            self._fail(f"rank 0's {method} failed: {e}")
        return [mine] + [self._receive(w, self.timeout_s) for w in self.workers]

    def _receive(self, w: Worker, timeout_s: float) -> Any:
        ready = wait([w.conn, w.process.sentinel], timeout_s)
        if w.conn in ready:
            try:
                status, value = w.conn.recv()
            except (EOFError, OSError):  # the pipe closed: the worker is gone
                status, value = "died", None
            if status in ("ok", "ready"):
                return value
            if status == "error":
                self._fail(f"rank {w.rank} raised:\n{value}")
        if not ready:
            self._fail(f"rank {w.rank} did not answer within {timeout_s:.0f} s")
        self._fail(self._death(w))

    def _check_alive(self, grace_s: float = 0.0) -> None:
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        for w in self.workers:
            if grace_s:  # a failed collective: give a dying worker time to be seen dead
                w.process.join(grace_s)
            if not w.process.is_alive():
                self._fail(self._death(w))

    @staticmethod
    def _death(w: Worker) -> str:
        return (
            f"expert-parallel worker rank {w.rank} (pid {w.process.pid}) died "
            f"with exit code {w.process.exitcode}"
        )

    def _fail(self, reason: str) -> None:
        """Stop every worker, and refuse every later call with the reason."""
        self.failure = reason
        self.shutdown()
        raise WorkerDiedError(f"{reason}; the engine has shut its workers down")

    def shutdown(self) -> None:
        self._finalizer()

    @property
    def pids(self) -> list[int]:
        return [w.process.pid for w in self.workers]
