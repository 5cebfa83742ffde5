"""The engine loop: requests in, one scheduled forward pass per step, outputs out.

This is the API a server drives (add_request, step, abort_request); LLM.generate
in llm.py is the same loop run to completion. The engine has two halves: the
core (scheduler, executor and model runner) decides and computes, and the
output processor turns each step's tokens into text for the callers.
"""

from __future__ import annotations

import atexit
import gc
import time
from pathlib import Path

from engine.config import EngineConfig
from engine.core.async_loop import AsyncLoop
from engine.core.output_processor import OutputProcessor, OutputSink
from engine.core.request_checker import BlockChain, Prompt, RequestChecker
from engine.core.trace import StepTrace
from engine.distributed.balancer import ExpertBalancer
from engine.executor.abstract import Executor
from engine.executor.uniproc_executor import UniProcExecutor
from engine.kv.block_manager import BlockManager
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.handoff import Handoff
from engine.kv.hashing import chain_root
from engine.kv.store_connector import StoreConnector, make_connector
from engine.models.loader import load_tokenizer
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence
from engine.spec_decode.factory import make_verify_schedule
from engine.stats import EngineStats
from engine.structured_output import StructuredOutputManager


def make_executor(config: EngineConfig, stats: EngineStats) -> Executor:
    if config.expert_parallel_size > 1:
        from engine.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, stats)
    return UniProcExecutor(config, stats)


def make_block_manager(
    config: EngineConfig, num_blocks: int, block_size: int, root: bytes
) -> BlockManager:
    """The block manager of the model's cache: one table for a cache of one KV-cache
    group, a coordinator across them for more (kv/coordinator.py)."""
    caching, groups = config.enable_prefix_caching, config.kv_cache_groups
    if groups.num_groups == 1:
        return BlockManager(num_blocks, block_size, caching, root)
    return KVCacheCoordinator(num_blocks, groups, caching, root)


def freeze_start_up() -> None:
    """What start-up built (torch, the model's modules, the block pool) lives as
    long as the engine: take it out of the garbage collector's full scans, which
    would otherwise walk all of it in the middle of some step. At exit it goes
    back, so that everything is finalized as usual."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)


class LLMEngine:
    def __init__(self, config: EngineConfig, output_processor: OutputSink | None = None) -> None:
        """``output_processor``: where every step's outputs go (OutputSink); None
        makes an OutputProcessor here. The engine, its async loop and its trace
        all use this one, so a request's outputs reach the processor that saw it."""
        self.config = config
        self.tokenizer = load_tokenizer(Path(config.model))
        self.stats = EngineStats()
        self.executor = make_executor(config, self.stats)
        self.eplb = ExpertBalancer(config, self.executor, self.stats)  # distributed/balancer.py
        cache = self.executor.kv_cache_config()
        self.max_model_len = cache.max_model_len
        root = chain_root(config.model_identity, config.kv_format, cache.block_size)
        self.block_manager = make_block_manager(config, cache.num_blocks, cache.block_size, root)
        self.connector = self._connector(config, cache.block_size, root)
        self.scheduler = self._scheduler(config)
        self.output_processor: OutputSink = (
            OutputProcessor(self.tokenizer) if output_processor is None else output_processor
        )
        self.structured_output = StructuredOutputManager(
            self.tokenizer,
            config.hf_config.vocab_size,
            config.hf_config.eos_token_ids,
            config.disable_any_whitespace,
        )
        self.checker = RequestChecker(
            self.tokenizer,
            config.hf_config.vocab_size,
            self.max_model_len,
            self.structured_output,
            config.seed,
            BlockChain(root, cache.block_size) if self.connector is not None else None,
        )
        self.async_loop = self._async_loop(config)
        self.trace = self._trace(config)
        freeze_start_up()

    def _scheduler(self, config: EngineConfig) -> Scheduler:
        """The scheduler over the engine's blocks, its connector and its drafts' schedule."""
        scheduler = AsyncScheduler if config.async_scheduling else Scheduler
        return scheduler(
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.block_manager,
            self.stats,
            eos_token_ids=config.hf_config.eos_token_ids,
            max_model_len=self.max_model_len,
            verify_schedule=make_verify_schedule(config, self.executor.measure_step_times),
            kv_window=config.kv_window,
            connector=self.connector,
        )

    def _async_loop(self, config: EngineConfig) -> AsyncLoop | None:
        """With async scheduling, the loop that runs one step ahead (async_loop.py)."""
        if not config.async_scheduling:
            return None
        args = self.scheduler, self.executor, self.output_processor, self.stats
        return AsyncLoop(*args, self.structured_output)

    def _trace(self, config: EngineConfig) -> StepTrace | None:
        """With trace=True or a path, the step trace (trace.py); None otherwise."""
        if not config.trace:
            return None
        path = config.trace if isinstance(config.trace, str) else None
        runner, processor = self.executor.model_runner, self.output_processor
        return StepTrace(self.scheduler, runner, processor, self.stats, path)

    def _connector(
        self, config: EngineConfig, block_size: int, root: bytes
    ) -> StoreConnector | None:
        """With a kv_store: the connector that loads blocks from it and saves them."""
        if config.kv_store is None:
            return None
        from engine.kv.store import open_store  # ValueError if it cannot be reached

        store = open_store(config.kv_store, config.kv_store_max_bytes)
        tokens = 4 * block_size
        [seconds] = self.executor.measure_step_times([tokens])
        stats, always = self.stats.kv_transfer, config.kv_store_load == "always"
        background = config.role != "prefill"  # its reply waits for the saves
        return make_connector(
            store, self.executor, block_size, root, stats, seconds, tokens, always, background
        )

    @property
    def requests(self) -> dict[str, Sequence]:
        """The unfinished requests, as the scheduler tracks them."""
        return self.scheduler.requests

    def make_sequence(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        handoff: Handoff | None = None,
        seed: int | None = None,
    ) -> Sequence:
        """Check a request and tokenize it, without touching the engine's state,
        so a bad request fails alone and nothing already queued is lost.
        ``seed``: the seed a front end already gave it (core_process.py)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        return self.checker.check(request_id, prompt, params, handoff, seed)

    def add_sequence(self, seq: Sequence, prompt: Prompt | None = None) -> None:
        """Queue a checked request: its text side to the output processor, its
        tokens to the scheduler."""
        text = prompt if isinstance(prompt, str) else None
        self.output_processor.add_request(
            seq.request_id, text, seq.prompt_token_ids, seq.params, seq.handoff
        )
        self.scheduler.add(seq)
        self.checker.num_added += 1

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        handoff: Handoff | None = None,
    ) -> None:
        self.add_sequence(self.make_sequence(request_id, prompt, params, handoff), prompt)

    def has_unfinished_requests(self) -> bool:
        """Requests not yet finished, or a step still in flight (async scheduling)."""
        in_flight = self.async_loop is not None and self.async_loop.in_flight is not None
        return self.scheduler.has_unfinished() or in_flight

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests([request_id], FinishReason.ABORT)
        self.output_processor.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """Schedule (grammar masks too), run the model, fold in the tokens, output."""
        if self.async_loop is not None:  # async scheduling: see async_loop.py
            return self.async_loop.step()
        start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.scheduled:
            return self._idle()  # KV loads in flight, or nothing can ever run
        self.structured_output.fill_bitmask(scheduler_output, self.requests)
        runner_output = self.executor.execute_model(scheduler_output)
        core_outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        processed = self.output_processor.process_outputs(core_outputs)
        self.scheduler.finish_requests(processed.reqs_to_abort, FinishReason.STOP)  # stop strings
        self.stats.step_seconds += time.perf_counter() - start
        return processed.request_outputs

    def settle(self) -> None:
        """Once the requests in hand are done (LLM.generate's end): the trace saved
        where trace= said, every rank's share of the expert stats summed, and what
        was saved to a KV store there when this returns."""
        if self.trace is not None:
            self.trace.save()
        if self.eplb.placement is not None:
            self.eplb.sync_stats()
        if self.connector is not None:
            self.connector.flush()

    def _idle(self) -> list[RequestOutput]:
        """A step that schedules nothing: fine while an outside source is still
        loading some request's KV (the scheduler holds it, WAITING_FOR_KV), an
        error otherwise, since the step after would schedule nothing either."""
        if self.scheduler.kv.loading:
            if self.connector is not None:  # wait a little for one, not spin
                self.connector.wait(timeout=0.01)
            return []
        raise RuntimeError("requests are waiting but none could be scheduled")

    def shutdown(self) -> None:
        """Stop the executor's workers, if it has any. Idempotent."""
        if self.connector is not None:
            self.connector.close()
            self.connector = None
        self.executor.shutdown()
