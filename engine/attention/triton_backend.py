"""The GPU attention backend: the Triton kernels of engine/kernels.

Decodes go to the split-KV decode kernel, prompt chunks to the varlen prefill
kernel, which reads the cached prefix and the new tokens alike through the
block table. On a CPU these kernels run only under TRITON_INTERPRET=1, which is
how the tests check them without a GPU.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionMetadata


class TritonBackend:
    name = "triton"

    def __init__(self, device: str) -> None:
        from engine.kernels import check_available

        check_available(device)  # a clear error, not a crash inside a kernel
        from engine import kernels

        self.kernels = kernels

    def prepare(self, meta: AttentionMetadata, block_size: int) -> None:
        """Decodes hold one query token each and come first, so the prompt chunks'
        queries start at row num_decodes."""
        d = meta.num_decodes
        if d < len(meta.query_lens_cpu):
            meta.prepared["prefill"] = (
                meta.cu_seqlens_q[d:] - d,
                meta.block_tables[d:],
                meta.context_lens[d:],
                max(meta.query_lens_cpu[d:]),  # known on the host: no wait for the GPU
            )

    def store_kvcache(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        self.kernels.store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    def mla_decode(self, q, cache, rank: int, meta: AttentionMetadata, scale: float):
        d = meta.num_decodes
        tables, lens = meta.block_tables[:d], meta.context_lens[:d]
        return self.kernels.paged_mla_decode(q, cache, tables, lens, rank, scale)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        out = torch.empty_like(q)
        d = meta.num_decodes
        if d:
            self.kernels.paged_decode_attention(
                q[:d],
                k_cache,
                v_cache,
                meta.block_tables[:d],
                meta.context_lens[:d],
                scale,
                out=out[:d],
            )
        if "prefill" in meta.prepared:
            cu_seqlens, tables, context_lens, longest = meta.prepared["prefill"]
            self.kernels.paged_prefill_attention(
                q[d:],
                k_cache,
                v_cache,
                tables,
                cu_seqlens,
                context_lens,
                scale,
                out=out[d:],
                max_seqlen_q=longest,
            )
        return out
