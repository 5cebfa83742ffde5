"""CUDA graphs for decode steps.

A decode step of a small batch launches a few hundred short kernels, and on a
fast GPU launching them takes longer than running them. A CUDA graph records
the launches once and replays them with one call. A graph replays fixed
shapes and fixed addresses, so we capture one graph per batch-size bucket over
static input buffers, copy each step's inputs into those buffers, and pad the
batch up to the next bucket.

Only decode-only steps on the Triton backend use graphs; prompt chunks vary too
much in shape and run eagerly. ``enforce_eager=True`` turns graphs off.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata, for_decodes
from engine.config import EngineConfig
from engine.models.base import CausalLM
from engine.utils import cdiv


def batch_buckets(max_batch: int) -> list[int]:
    """Batch sizes to capture: small powers of two, then every 16."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_batch]
    buckets += list(range(16, max_batch + 1, 16))
    if buckets[-1] != max_batch:
        buckets.append(max_batch)
    return buckets


def bucket_for(batch: int, buckets: list[int]) -> int | None:
    """The smallest captured size that holds ``batch``, or None if none does."""
    return next((b for b in buckets if b >= batch), None)


class CUDAGraphRunner:
    builds_own_metadata = True  # a DecodeFastPath (fast_path.py)

    def __init__(
        self,
        model: nn.Module,
        backend: AttentionBackend,
        max_batch: int,
        max_blocks: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model, self.backend = model, backend
        self.buckets = batch_buckets(max_batch)
        self.max_blocks = max_blocks
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.hidden = torch.zeros((n, hidden_size), dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._capture_all()

    def _meta(self, bs: int) -> AttentionMetadata:
        return for_decodes(
            self.slot_mapping[:bs],
            self.block_tables[:bs],
            self.context_lens[:bs],
            [1] * bs,
            self.cu_seqlens_q[: bs + 1],
        )

    def _forward(self, bs: int) -> None:
        meta = self._meta(bs)
        with forward_context(meta, self.backend.build_metadata(meta), self.backend):
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs])

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for bs in reversed(self.buckets):  # largest first: the others reuse its memory
            self._forward(bs)  # warm up: Triton compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def can_run(self, meta: AttentionMetadata) -> bool:
        seqs = len(meta.query_lens_cpu)
        return (
            meta.decodes_only()
            and bucket_for(seqs, self.buckets) is not None
            and meta.block_tables.shape[1] <= self.max_blocks
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        attn_metadata: Any = None,
    ) -> torch.Tensor:
        """Copy this step into the static buffers, pad to the bucket, replay (the
        captured kernels read their own metadata: ``attn_metadata`` is unused)."""
        n = len(meta.query_lens_cpu)
        bs = bucket_for(n, self.buckets)
        width = meta.block_tables.shape[1]
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1  # padding rows write nothing...
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:bs] = 1  # ...and read one finite slot of block 0
        self.block_tables[:n, :width] = meta.block_tables.clamp(min=0)
        self.block_tables[n:bs] = 0
        self.graphs[bs].replay()
        return self.hidden[:n]


def cuda_graphs_for(
    c: EngineConfig,
    model: CausalLM,
    backend: AttentionBackend,
    max_model_len: int,
    device: torch.device,
) -> CUDAGraphRunner | None:
    """Graphs for decode steps on a GPU with the Triton backend, unless
    enforce_eager; None elsewhere."""
    if not (
        device.type == "cuda"
        and backend.name == "triton"
        and not c.enforce_eager
        and model.supports_cuda_graphs
    ):
        return None
    max_blocks = cdiv(max_model_len, c.block_size)
    return CUDAGraphRunner(
        model,
        backend,
        min(c.max_num_seqs, 256),
        max_blocks,
        c.hf_config.hidden_size,
        c.dtype,
        device,
    )
