"""The front end's side of the engine, in the asyncio loop: requests go to the
engine core (a thread or a process: engine_core.py, core_process.py) once
checked, and each step's core outputs come back and become RequestOutputs
here, through the engine's own OutputProcessor.

Nothing here waits for a model step. A request's outputs are put on the
asyncio queue its HTTP handler reads; a handler that goes away aborts its
requests, and the core frees their blocks at its next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass
from typing import Literal

from engine.config import EngineConfig
from engine.core.output_processor import OutputProcessor
from engine.entrypoints.core_process import CoreProcess
from engine.entrypoints.engine_core import CoreBatch, CoreClient, EngineCore
from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.metrics import ServerMetrics
from engine.kv.handoff import Handoff
from engine.outputs import EngineCoreEventType, EngineCoreOutput, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("deepinfer.server")
SHUTTING_DOWN = "the server is shutting down; retry on another"
# Where the engine core runs: in a process of its own (what `deepinfer serve`
# does), or in a thread of the server's (tests that reach into the engine).
CoreMode = Literal["process", "thread"]


@dataclass
class EngineFailure:
    """Put on a request's queue in place of an output when it cannot go on: the
    engine failed it (500), or the server is shutting down (503)."""

    request_id: str
    message: str
    status: int = 500


@dataclass
class Timing:
    """One request's clock, for the latency histograms."""

    arrival: float
    counts_prompt: bool = True  # False for choices 2..n of one prompt
    first_token: float = 0.0
    last_token: float | None = None
    num_tokens: int = 0


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        metrics: ServerMetrics,
        max_waiting: int,
        core: CoreMode = "thread",
    ) -> None:
        self.config = config
        self.core: CoreClient = (
            CoreProcess(config) if core == "process" else EngineCore.in_thread(config)
        )
        self.tokenizer = self.core.tokenizer
        facts = self.core.facts
        # The store's key space (Chapter 8): the chain root, None without a store.
        self.kv_root = facts.kv_root
        self.block_size = facts.block_size
        self.max_model_len = facts.max_model_len
        self.processor = OutputProcessor(self.tokenizer)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.sinks: dict[str, asyncio.Queue] = {}  # request id -> its handler's queue
        self.timing: dict[str, Timing] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.draining = False  # shutting down: no new requests

    @property
    def num_waiting(self) -> int:
        """Accepted requests that have no token yet: queued, or in prefill."""
        return sum(1 for t in self.timing.values() if t.last_token is None)

    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.core.start(lambda batch: self.loop.call_soon_threadsafe(self._on_batch, batch))

    def stop(self) -> None:
        self.core.stop()

    @property
    def healthy(self) -> bool:
        return self.core.alive

    def generate(
        self,
        requests: dict[str, tuple[list[int], SamplingParams]],
        repeats: Collection[str] = (),
        handoff: Handoff | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue several requests (the choices of one HTTP request), all checked
        before any is queued, so that a refusal comes before any response starts;
        then iterate to get their outputs as they come. ``repeats``: requests
        whose prompt an earlier one of them has (choices 2..n of a prompt), so
        that the prompt's tokens count once. ``handoff``: the one request is
        continued from another engine (kv/handoff.py)."""
        if not self.healthy:
            raise OpenAIError(503, f"the engine is not running: {self.core.dead}")
        if self.draining:
            raise OpenAIError(503, SHUTTING_DOWN, headers={"Retry-After": "1"})
        if self.num_waiting + len(requests) > self.max_waiting:
            self.metrics.rejected.inc()
            raise OpenAIError(
                503,
                f"too many requests waiting (at most {self.max_waiting}); retry shortly",
                headers={"Retry-After": "1"},
            )
        try:
            seqs = [
                self.core.make_sequence(rid, ids, p, handoff) for rid, (ids, p) in requests.items()
            ]
        except ValueError as err:
            param = "logit_bias" if "logit_bias" in str(err) else "prompt"
            raise OpenAIError(400, str(err), param=param) from err
        sink: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        for seq in seqs:
            self.processor.add_request(
                seq.request_id, None, seq.prompt_token_ids, seq.params, seq.handoff
            )
            self.sinks[seq.request_id] = sink
            self.timing[seq.request_id] = Timing(now, counts_prompt=seq.request_id not in repeats)
        self.core.add(seqs)
        return self._outputs(sink, set(requests))

    async def _outputs(
        self, sink: asyncio.Queue, pending: set[str]
    ) -> AsyncIterator[RequestOutput]:
        """Whatever is unfinished when the caller stops listening is aborted."""
        try:
            while pending:
                item = await sink.get()
                if isinstance(item, EngineFailure):
                    message = (
                        item.message if item.status != 500 else f"the engine failed: {item.message}"
                    )
                    raise OpenAIError(item.status, message)
                if item.finished:
                    pending.discard(item.request_id)
                yield item
        finally:
            if pending:  # the client went away, or another choice failed
                self.abort(list(pending))

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests whose client went away; finished ones are left alone."""
        unfinished = [rid for rid in request_ids if self.sinks.pop(rid, None) is not None]
        for request_id in unfinished:
            self.processor.abort_request(request_id)
            del self.timing[request_id]
            self.metrics.aborted.inc()
        if unfinished:
            self.core.abort(unfinished)

    def _on_batch(self, batch: CoreBatch) -> None:
        """One step's outputs, in the loop's thread: text, stop strings, metrics."""
        self.metrics.core_stats(batch.stats)
        try:
            self._deliver(batch.outputs)
        except Exception as err:  # a bug on this side fails the step's requests, not the server
            failed = [o.request_id for o in batch.outputs if o.request_id in self.sinks]
            logger.exception("processing the outputs of %s failed", ", ".join(failed))
            self.core.abort(failed)
            self._fail(dict.fromkeys(failed, f"{type(err).__name__}: {err}"))
        self._fail(batch.failed)
        if self.core.dead:  # nothing more will come: fail whoever still waits
            for request_id in list(self.sinks):
                self.sinks.pop(request_id).put_nowait(EngineFailure(request_id, self.core.dead))

    def _deliver(self, outputs: list[EngineCoreOutput]) -> None:
        now = time.perf_counter()
        known = [o for o in outputs if o.request_id in self.sinks]  # not aborted
        processed = self.processor.process_outputs(known)
        if processed.reqs_to_abort:  # a stop string ended them here; stop the core too
            self.core.abort(processed.reqs_to_abort)
        for out in processed.request_outputs:
            self._observe(out, now)
            sink = self.sinks[out.request_id]
            if out.finished:
                del self.sinks[out.request_id]
            sink.put_nowait(out)

    def drain(self, timeout: float) -> None:
        """Shutting down: take no new requests, and end those still unfinished
        after ``timeout`` seconds with a 503 (an error event, in a stream)."""
        self.draining = True
        self.loop.call_later(timeout, self._end_all)

    def _end_all(self) -> None:
        unfinished = list(self.sinks)
        if unfinished:
            logger.warning("shutting down: ending %d unfinished requests", len(unfinished))
            self.core.abort(unfinished)
            self._fail(dict.fromkeys(unfinished, SHUTTING_DOWN), status=503)

    def _fail(self, failed: dict[str, str], status: int = 500) -> None:
        """Requests that will get no more outputs: their handlers answer with ``status``."""
        for request_id, message in failed.items():
            if (sink := self.sinks.pop(request_id, None)) is not None:
                self.processor.abort_request(request_id)
                self.timing.pop(request_id, None)
                self.metrics.failed.inc()
                sink.put_nowait(EngineFailure(request_id, message, status))

    def _observe(self, out: RequestOutput, now: float) -> None:
        m, t = self.metrics, self.timing[out.request_id]
        new = len(out.token_ids) - t.num_tokens
        if t.last_token is None:
            m.ttft.observe(now - t.arrival)
            if t.counts_prompt:
                m.prompt_tokens.inc(len(out.prompt_token_ids))
            m.prefix_lookup(len(out.prompt_token_ids), out.num_cached_tokens)
            scheduled = [e.time for e in out.events if e.type is EngineCoreEventType.SCHEDULED]
            if scheduled:
                m.queue_time.observe(scheduled[0] - t.arrival)
                m.prefill_time.observe(now - scheduled[-1])
            t.first_token = now
        else:
            m.itl.observe(now - t.last_token)
        m.generation_tokens.inc(new)
        t.last_token, t.num_tokens = now, len(out.token_ids)
        if out.finished:
            m.e2e.observe(now - t.arrival)
            m.decode_time.observe(now - t.first_token)
            m.finished(out.finish_reason)
            del self.timing[out.request_id]
