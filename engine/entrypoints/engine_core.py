"""The engine core: it takes requests and aborts from a queue, steps the engine
while any request is unfinished, and hands every step's EngineCoreOutputs to the
front end, which turns them into text. It runs in a thread of its own beside the
front end (EngineCore.in_thread), or in a process of its own (core_process.py), and
the front end sees either through the same small interface (CoreClient).

LLMEngine.step ends by handing the step's outputs to its output processor. Here
the engine is built with an outbox as that processor: the outputs cross to the
front end's thread as the plain data they are, and the front end runs the real
OutputProcessor. The step itself is the engine's own, unchanged.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.output_processor import ProcessedOutputs
from engine.entrypoints.host_memory import HeapTrimmer, bound_onednn_caches
from engine.kv.handoff import Handoff
from engine.kv.store.base import StoreStats
from engine.outputs import EngineCoreOutput
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.stats import KVTransferRecord, KVTransferStats, SpecDecodeStats

logger = logging.getLogger("deepinfer.server")


class Outbox:
    """The engine's output processor in the core (an OutputSink, given to
    LLMEngine when it is built): keeps the step's core outputs for the front end
    instead of turning them into text here."""

    def __init__(self) -> None:
        self.outputs: list[EngineCoreOutput] = []

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handoff: Handoff | None = None,
    ) -> None:  # the front end follows the request
        pass

    def abort_request(self, request_id: str) -> None:
        pass

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        self.outputs += outputs
        return ProcessedOutputs([], [])  # stop strings come back later, as aborts

    def take(self) -> list[EngineCoreOutput]:
        outputs, self.outputs = self.outputs, []
        return outputs


@dataclass
class CoreStats:
    """The core's state after a step, for the front end's gauges."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # share of the cache's blocks that requests hold
    num_preemptions: int  # since start
    # Speculative decoding's counts since start (a copy), and target forward
    # passes per generated token since start.
    spec_decode: SpecDecodeStats = field(default_factory=SpecDecodeStats)
    forwards_per_output_token: float = 0.0
    kv_transfer: KVTransferStats = field(default_factory=KVTransferStats)  # a copy
    # Each request's load or save since the last step's stats, and the store's
    # own counts (None without a store)
    kv_records: list[KVTransferRecord] = field(default_factory=list)
    kv_store: StoreStats | None = None


@dataclass
class CoreBatch:
    """What one step sends to the front end."""

    outputs: list[EngineCoreOutput]
    stats: CoreStats
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error
    dead: str | None = None  # why the core stopped for good, if it did


@dataclass(frozen=True)
class CoreFacts:
    """What the front end needs to know of the loaded engine to check requests."""

    max_model_len: int
    block_size: int
    kv_root: bytes | None  # the KV store's chain root; None without a store


class CoreClient(Protocol):
    """The front end's view of an engine core, in a thread or a process."""

    facts: CoreFacts
    tokenizer: Tokenizer | None
    dead: str | None  # why the core stopped for good, if it did

    @property
    def alive(self) -> bool: ...

    def make_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        handoff: Handoff | None = None,
    ) -> Sequence:
        """Check a request (ValueError if bad); safe in the front end's thread."""
        ...

    def add(self, seqs: list[Sequence]) -> None: ...

    def abort(self, request_ids: list[str]) -> None: ...

    def start(self, deliver: Callable[[CoreBatch], None]) -> None:
        """Begin stepping; ``deliver`` gets every batch, in a thread of the core's."""
        ...

    def stop(self) -> None: ...


_STOP = object()
# While background saves run, an idle core wakes this often to send their counts.
SAVE_POLL_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        bound_onednn_caches()  # before the model loads (host_memory.py)
        self.outbox = Outbox()
        # Loads the model, in the caller's thread; every step's outputs go to the outbox.
        self.engine = LLMEngine(config, output_processor=self.outbox)
        self.trimmer = HeapTrimmer()
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread: threading.Thread | None = None  # in_thread's; None: run() in the caller's
        self._starts: queue.SimpleQueue = queue.SimpleQueue()  # start()'s deliver, for that thread
        self.dead: str | None = None  # why the core stopped, if it failed for good
        self.rejected: dict[str, str] = {}  # requests refused on arrival, for the next batch
        self._sent_saving = False
        self.tokenizer: Tokenizer | None = self.engine.tokenizer
        engine = self.engine
        root = engine.block_manager.root if engine.connector is not None else None
        self.facts = CoreFacts(engine.max_model_len, engine.block_manager.block_size, root)

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and self.dead is None

    def make_sequence(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        handoff: Handoff | None = None,
    ) -> Sequence:
        """Check a request (ValueError if bad) without touching the core's state;
        safe to call from the front end's thread."""
        return self.engine.make_sequence(request_id, token_ids, params, handoff)

    def add(self, seqs: list[Sequence]) -> None:
        self.inbox.put(("add", seqs))

    def abort(self, request_ids: list[str]) -> None:
        self.inbox.put(("abort", request_ids))

    @classmethod
    def in_thread(cls, config: EngineConfig) -> EngineCore:
        """A core in a thread of its own, which loads the model, then steps it
        once started. On a CPU the thread that runs the forward pass must be the
        one that loaded the model: each thread that runs torch's parallel
        operators gets an OpenMP pool of its own, and two pools on too few cores
        slow every forward pass (runner/torch_thread.py)."""
        made: queue.SimpleQueue = queue.SimpleQueue()
        thread = threading.Thread(
            target=cls._thread_main, args=(config, made), name="engine-core", daemon=True
        )
        thread.start()
        core = made.get()
        if isinstance(core, BaseException):
            raise core
        return core

    @classmethod
    def _thread_main(cls, config: EngineConfig, made: queue.SimpleQueue) -> None:
        try:
            core = cls(config)
        except BaseException as err:  # for the caller of in_thread to raise
            made.put(err)
            return
        core.thread = threading.current_thread()
        made.put(core)
        deliver = core._starts.get()
        if deliver is not None:  # None: stopped before it started
            core.run(deliver)

    def start(self, deliver: Callable[[CoreBatch], None]) -> None:
        """Begin stepping, in the core's thread (made by in_thread)."""
        if self.thread is None:
            raise RuntimeError("start() needs a core made by EngineCore.in_thread")
        self._starts.put(deliver)

    def reject(self, failures: list[tuple[str, str]]) -> None:
        """Requests refused on arrival: (request id, why), sent with the next batch."""
        self.inbox.put(("reject", failures))

    def stop_soon(self) -> None:
        """End the loop before its next step."""
        self.inbox.put(_STOP)

    def stop(self) -> None:
        if self.thread is not None:
            self.stop_soon()
            # A core never started waits for this; a running one never reads it.
            self._starts.put(None)
            self.thread.join(timeout=30)

    def run(self, deliver: Callable[[CoreBatch], None]) -> None:
        """The core's loop, in the calling thread, until stop()."""
        try:
            self._loop(deliver)
        except Exception as err:  # outside a step: nothing to recover, but nobody waits forever
            self.dead = f"{type(err).__name__}: {err}"
            logger.exception("the engine core stopped")
            deliver(self._batch([]))  # the front end fails whoever waits

    def _loop(self, deliver: Callable[[CoreBatch], None]) -> None:
        engine = self.engine
        while True:
            busy, saving = engine.has_unfinished_requests(), self._saving() or self._sent_saving
            # idle: sleep until a request comes, or a save may have ended; busy: take what has come
            try:
                command = self.inbox.get(block=not busy, timeout=SAVE_POLL_S if saving else None)
            except queue.Empty:
                command = None
            applied = command is not None
            while command is not None:
                if command is _STOP:
                    return
                self._apply(command)
                command = self.inbox.get_nowait() if not self.inbox.empty() else None
            if engine.has_unfinished_requests():
                failed = self._step()
                deliver(self._batch(self.outbox.take(), failed))
                if self.dead:
                    return
            elif applied or saving:  # idle after aborts, or saves landing: say so
                deliver(self._batch([]))
            if not engine.has_unfinished_requests():  # idle: give the heap's free pages back
                self.trimmer.maybe_trim()

    def _saving(self) -> bool:
        """Background saves to the KV store are running: their counts are not all
        in the stats yet (``_sent_saving``: they were when the last were taken)."""
        connector = self.engine.connector
        return connector is not None and connector.saving()

    def _apply(self, command: tuple[str, list]) -> None:
        kind, items = command
        if kind == "reject":  # (request id, why) pairs, for the front end
            self.rejected.update(items)
            return
        for item in items:
            if kind == "add":
                self.engine.add_sequence(item)
            else:
                self.engine.abort_request(item)  # a finished id is ignored

    def _batch(
        self, outputs: list[EngineCoreOutput], failed: dict[str, str] | None = None
    ) -> CoreBatch:
        """What goes to the front end after a step, or when idle."""
        failed = {**self.rejected, **(failed or {})}
        self.rejected = {}
        return CoreBatch(outputs, self._stats(), failed, self.dead)

    def _step(self) -> dict[str, str]:
        """One engine step. If it fails, every request in the engine fails with it
        (there is no telling which one caused it), its blocks are freed, and the
        core goes on serving new requests."""
        try:
            self.engine.step()
            return {}
        except Exception as err:
            failed = {rid: f"{type(err).__name__}: {err}" for rid in self.engine.requests}
            logger.exception("engine step failed; failing requests %s", ", ".join(failed))
            self.outbox.take()
            try:
                for request_id in failed:
                    self.engine.abort_request(request_id)
            except Exception:
                self.dead = f"could not recover from {type(err).__name__}: {err}"
                logger.exception("the engine core cannot recover")
            return failed

    def _stats(self) -> CoreStats:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        total, connector = len(blocks.blocks), self.engine.connector
        self._sent_saving = self._saving()  # then stats go once more, with their counts
        return CoreStats(
            num_running=len(scheduler.running),
            num_waiting=len(scheduler.waiting),
            kv_cache_usage=(total - blocks.num_free_blocks) / total,
            num_preemptions=self.engine.stats.preemptions,
            spec_decode=copy.deepcopy(self.engine.stats.spec_decode),
            forwards_per_output_token=self.engine.stats.forwards_per_output_token,
            kv_transfer=copy.copy(self.engine.stats.kv_transfer),
            kv_records=connector.take_records() if connector else [],
            kv_store=connector.backend_stats() if connector else None,
        )
