"""The engine core in a process of its own, as `deepinfer serve` runs it.

In one process, the core thread and the asyncio front end share one
interpreter lock. The core releases it in every torch operation of its forward
pass and takes it back after; each time the front end has taken it in
between, to stream a token or read a socket, the core waits, and then waits
again to be woken. With 64 streaming clients that made the server's forward
pass about 1.8 times slower than the same pass offline, though neither
thread kept a core busy (stop 41's closing note has the measurements).

So the core runs here, in a child process with an interpreter of its own, and
the two sides exchange plain data over a pipe:

    front end -> core   ("add", [QueuedRequest]), ("abort", [request id]), STOP
    core -> front end   CoreFacts once the model is loaded, then a CoreBatch a step

The front end checks each request itself, with the engine's own RequestChecker
built from the core's CoreFacts, so a bad request is still a 400 that never
reaches the core. The core builds the request again from the same data (a
grammar matcher cannot cross a pipe), with the seed the front end gave it.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

from engine.config import EngineConfig
from engine.core.request_checker import BlockChain, RequestChecker
from engine.entrypoints import logs
from engine.entrypoints.engine_core import CoreBatch, CoreFacts, CoreStats, EngineCore
from engine.kv.handoff import Handoff
from engine.models.loader import load_tokenizer
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured_output import StructuredOutputManager

logger = logging.getLogger("deepinfer.server")
STOP = "stop"
STOP_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class QueuedRequest:
    """A checked request, as it crosses to the core."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    handoff: Handoff | None


@dataclass(frozen=True)
class StartFailed:
    """Sent instead of CoreFacts when the engine could not be built."""

    error: str


class CoreProcess:
    """The front end's handle on a core process (a CoreClient)."""

    def __init__(self, config: EngineConfig) -> None:
        context = mp.get_context("spawn")  # a fresh interpreter: no threads forked
        self._conn, child = context.Pipe()
        # Not a daemon: a core with expert parallelism starts worker processes.
        # The core logs as the front end does: at its level, in its format.
        level = logging.getLogger().getEffectiveLevel()
        self.process = context.Process(
            target=run_core, args=(config, child, level), name="deepinfer-core"
        )
        self.process.start()
        child.close()
        facts = self._first_reply()
        self.facts: CoreFacts = facts
        self.tokenizer = load_tokenizer(Path(config.model))
        hf = config.hf_config
        grammars = StructuredOutputManager(
            self.tokenizer, hf.vocab_size, hf.eos_token_ids, config.disable_any_whitespace
        )
        self.checker = RequestChecker(
            self.tokenizer,
            hf.vocab_size,
            facts.max_model_len,
            grammars,
            config.seed,
            BlockChain(facts.kv_root, facts.block_size) if facts.kv_root is not None else None,
        )
        self.dead: str | None = None
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        self._stopping = False

    def _first_reply(self) -> CoreFacts:
        try:
            reply = self._conn.recv()  # the model is loaded, or it failed
        except EOFError:
            self.process.join()
            raise RuntimeError(
                f"the engine core process exited with code {self.process.exitcode} "
                "before it was ready"
            ) from None
        if isinstance(reply, StartFailed):
            self.process.join()
            raise RuntimeError(f"the engine core could not start: {reply.error}")
        return reply

    @property
    def alive(self) -> bool:
        receiving = self._receiver is not None and self._receiver.is_alive()
        return receiving and self.process.is_alive() and self.dead is None

    def make_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        handoff: Handoff | None = None,
    ) -> Sequence:
        return self.checker.check(request_id, token_ids, params, handoff)

    def add(self, seqs: list[Sequence]) -> None:
        requests = [
            QueuedRequest(s.request_id, s.prompt_token_ids, s.params, s.seed, s.handoff)
            for s in seqs
        ]
        self.checker.num_added += len(seqs)
        self._send(("add", requests))

    def abort(self, request_ids: list[str]) -> None:
        self._send(("abort", request_ids))

    def _send(self, message: object) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, OSError):  # the core is gone; the receiver says so
            pass

    def start(self, deliver: Callable[[CoreBatch], None]) -> None:
        self._receiver = threading.Thread(
            target=self._receive, args=(deliver,), name="core-receiver", daemon=True
        )
        self._receiver.start()

    def _receive(self, deliver: Callable[[CoreBatch], None]) -> None:
        """Every batch the core sends, to ``deliver``, until the pipe closes."""
        stats = CoreStats(0, 0, 0.0, 0)
        while True:
            try:
                batch: CoreBatch = self._conn.recv()
            except (EOFError, OSError):
                break
            stats = batch.stats
            if batch.dead:
                self.dead = batch.dead
            deliver(batch)
        if not self._stopping and self.dead is None:
            self.process.join(timeout=5)
            self.dead = f"the engine core process exited (code {self.process.exitcode})"
            logger.error(self.dead)
            deliver(CoreBatch([], stats, dead=self.dead))  # the front end fails whoever waits

    def stop(self) -> None:
        self._stopping = True
        self._send(STOP)
        self.process.join(timeout=STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(timeout=STOP_TIMEOUT_S)
        self._conn.close()


def run_core(config: EngineConfig, conn: Connection, log_level: int = logging.WARNING) -> None:
    """The core process: build the engine, say so, then step until told to stop
    or until the front end is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when to stop
    logs.configure(logging.getLevelName(log_level))
    try:
        core = EngineCore(config)
    except Exception as err:
        conn.send(StartFailed(f"{type(err).__name__}: {err}"))
        return
    conn.send(core.facts)
    send_lock = threading.Lock()

    def deliver(batch: CoreBatch) -> None:
        try:
            with send_lock:
                conn.send(batch)
        except (BrokenPipeError, OSError):  # the front end is gone: stop
            core.stop_soon()

    reader = threading.Thread(target=_read, args=(core, conn), name="core-inbox", daemon=True)
    reader.start()
    core.run(deliver)
    core.engine.shutdown()


def _read(core: EngineCore, conn: Connection) -> None:
    """The front end's messages, into the core's inbox; the requests built here,
    so that a grammar compiles outside the core's loop."""
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the front end is gone: stop
            message = STOP
        if message == STOP:
            core.stop_soon()
            return
        kind, items = message
        if kind == "abort":
            core.abort(items)
            continue
        seqs, rejected = [], []
        for r in items:
            try:
                seq = core.engine.make_sequence(
                    r.request_id, r.prompt_token_ids, r.params, r.handoff, r.seed
                )
            except ValueError as err:  # checked in the front end: only a bug gets here
                rejected.append((r.request_id, f"ValueError: {err}"))
            else:
                seqs.append(seq)
        core.add(seqs)
        if rejected:
            core.reject(rejected)
