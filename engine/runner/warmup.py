"""Steps of dummy sequences, run before any request: compiling the decode step
(compiled_decode.py) at each batch size it needs, and timing decode steps for
the verify-length schedule (spec_decode/verify_length.py).

The dummies are one-token decodes at position 0, all in block 0 of the cache.
What they write there is zeroed again before any request gets the block, and
the MoE layers' routing counts they leave are put back as they were."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata, for_decodes
from engine.kv.kv_cache import KVCachePool
from engine.models.base import CausalLM
from engine.runner.compiled_decode import CompiledDecode
from engine.stats import EngineStats
from engine.utils import to_device


def dummy_decodes(
    n: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A decode step of n dummy sequences, one token each at position 0, in
    block 0: their token ids, positions and attention metadata."""
    ids = to_device([0] * n, torch.int64, device)
    tables = to_device([[0]] * n, torch.int32, device)
    lens = to_device([1] * n, torch.int32, device)
    return ids, ids.clone(), for_decodes(ids.clone(), tables, lens, [1] * n)


@contextmanager
def in_block_zero(pool: KVCachePool, stats: EngineStats) -> Iterator[None]:
    """Dummy steps route no real tokens and own no block: the MoE layers' counts,
    which EPLB and the metrics read, are put back as they were, and block 0 is
    zeroed again before a request gets it."""
    counts = stats.expert_tokens
    saved = None if counts is None else counts.clone()
    pool.touch(1)
    try:
        yield
    finally:
        pool.forget_touched()
        if saved is not None:
            counts.copy_(saved)


def compile_decode_now(
    compiled: CompiledDecode,
    backend: AttentionBackend,
    pool: KVCachePool,
    stats: EngineStats,
    device: torch.device,
) -> None:
    """Compile before the first request rather than in the middle of it: a
    decode step of dummy sequences at each batch size that needs a graph of
    its own."""
    with in_block_zero(pool, stats):
        for n in compiled.warm_batches:
            ids, positions, meta = dummy_decodes(n, device)  # made outside inference mode
            with (
                torch.inference_mode(),
                forward_context(meta, backend.build_metadata(meta), backend),
            ):
                compiled(ids, positions)
    compiled.steps = 0


@torch.inference_mode()
def measure_step_times(
    model: CausalLM,
    backend: AttentionBackend,
    pool: KVCachePool,
    stats: EngineStats,
    sizes: list[int],
    device: torch.device,
) -> list[float]:
    """Seconds of a decode step of n one-token sequences, for each n in
    ``sizes`` (the verify-length schedule's cost side): the median of five
    runs after a warm-up."""
    with in_block_zero(pool, stats):
        return [step_time(model, backend, n, device) for n in sizes]


def step_time(model: CausalLM, backend: AttentionBackend, n: int, device: torch.device) -> float:
    """The median of five decode steps of n dummy one-token sequences, after one."""
    ids, positions, meta = dummy_decodes(n, device)
    runs = []
    with forward_context(meta, backend.build_metadata(meta), backend):
        for _ in range(6):
            start = time.perf_counter()
            model.compute_logits(model(ids, positions))
            runs.append(time.perf_counter() - start)
    return sorted(runs[1:])[2]
