"""The GPU attention backend: the Triton kernels of engine/kernels.

Decodes go to the split-KV decode kernel, prompt chunks to the varlen prefill
kernel, which reads the cached prefix and the new tokens alike through the
block table. RMSNorm (fused with the residual add) and RoPE run as Triton
kernels too. On a CPU these kernels run only under TRITON_INTERPRET=1, which
is how the tests check them without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, one_query_per_row
from engine.attention.torch_backend import TorchLatents
from engine.kv.kv_cache import LatentKV, PagedKV, store_kvcache


@dataclass
class PrefillBatch:
    """The step's prompt chunks, as the prefill kernel takes them."""

    cu_seqlens_q: torch.Tensor  # [chunks + 1] query starts, counted from row num_decodes
    block_tables: torch.Tensor  # [chunks, max_blocks]
    context_lens: torch.Tensor  # [chunks]
    max_seqlen_q: int  # known on the host: no wait for the GPU


@dataclass
class TritonAttentionMetadata:
    num_decodes: int  # decodes come first, one query row each
    block_tables: torch.Tensor  # [num_decodes, max_blocks]
    context_lens: torch.Tensor  # [num_decodes]
    prefill: PrefillBatch | None  # None when the step holds only decodes


class TritonBackend(TorchLatents):  # MLA's store and gather, in torch
    name = "triton"

    def __init__(self, device: str, batch_invariant: bool = False) -> None:
        from engine.kernels import check_available

        check_available(device)  # a clear error, not a crash inside a kernel
        from engine import kernels

        self.kernels = kernels
        self.batch_invariant = batch_invariant

    def build_metadata(self, meta: AttentionMetadata) -> TritonAttentionMetadata:
        """Views of the step's tensors, nothing computed: a CUDA graph captures
        them over its static buffers. Prompt chunks' queries start at row
        num_decodes. Batch-invariant: every query goes to the decode kernel,
        whose fixed KV split then serves prompt chunks and decodes alike."""
        if self.batch_invariant:
            meta = one_query_per_row(meta)
        d = meta.num_decodes
        prefill = None
        if d < len(meta.query_lens_cpu):
            prefill = PrefillBatch(
                meta.cu_seqlens_q[d:] - d,
                meta.block_tables[d:],
                meta.context_lens[d:],
                max(meta.query_lens_cpu[d:]),
            )
        return TritonAttentionMetadata(d, meta.block_tables[:d], meta.context_lens[:d], prefill)

    def store_kvcache(self, k, v, cache: PagedKV, slot_mapping) -> None:
        if cache.k_scale is not None:  # quantized, in torch: engine/kv/quant.py
            store_kvcache(k, v, cache, slot_mapping)
            return
        self.kernels.store_kvcache(k, v, cache.k, cache.v, slot_mapping)

    def forward(self, q, k, v, cache: PagedKV, attn_metadata: TritonAttentionMetadata, scale):
        out = torch.empty_like(q)
        d, prefill = attn_metadata.num_decodes, attn_metadata.prefill
        if d:
            self.kernels.paged_decode_attention(
                q[:d],
                cache.k,
                cache.v,
                attn_metadata.block_tables,
                attn_metadata.context_lens,
                scale,
                out=out[:d],
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
            )
        if prefill is not None:
            self.kernels.paged_prefill_attention(
                q[d:],
                cache.k,
                cache.v,
                prefill.block_tables,
                prefill.cu_seqlens_q,
                prefill.context_lens,
                scale,
                out=out[d:],
                max_seqlen_q=prefill.max_seqlen_q,
                k_scale=cache.k_scale,
                v_scale=cache.v_scale,
            )
        return out

    def mla_decode(
        self, q, cache: LatentKV, rank: int, attn_metadata: TritonAttentionMetadata, scale
    ):
        """Absorbed MLA decode over the paged latents: engine/kernels/mla_decode.py."""
        tables, lens = attn_metadata.block_tables, attn_metadata.context_lens
        return self.kernels.paged_mla_decode(q, cache.rows, tables, lens, rank, scale)

    def rms_norm(self, x, residual, weight, eps):
        rows = x.reshape(-1, x.shape[-1])  # q/k norms see [tokens, heads, head_dim]
        if residual is None:
            return self.kernels.rms_norm(rows, weight, eps).view(x.shape)
        out, summed = self.kernels.fused_add_rms_norm(
            rows, residual.reshape(rows.shape), weight, eps
        )
        return out.view(x.shape), summed.view(x.shape)

    def rotary_embedding(self, positions, q, k, cos_sin_cache):
        return self.kernels.rotary_embedding(positions, q, k, cos_sin_cache)

    def sparse_mla_decode(self, q, cache: LatentKV, rank: int, chosen, block_tables, scale):
        """Absorbed MLA decode over the chosen rows alone: engine/kernels/sparse_mla_decode.py."""
        return self.kernels.sparse_mla_decode(q, cache.rows, block_tables, chosen, rank, scale)
