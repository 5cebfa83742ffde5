"""DeepSeek-V3.2: DeepSeek-V3 with DeepSeek Sparse Attention (DSA) in every layer.

Each layer's MLA gains a lightning indexer (engine/layers/indexer.py): from the
query latent and the hidden state it scores every cached token for each query
and keeps the index_topk best, and MLA attends to those alone
(engine/layers/mla.py). The indexer's keys are cached beside the latents, in the
same blocks (engine/kv/sparse_cache.py). The rest is DeepSeek-V3's, unchanged.

V3.2's MTP module (stored as layer num_hidden_layers) is a V3.2 layer too, with
its own indexer, and drafts as V3's does (engine/spec_decode/mtp.py).
"""

from __future__ import annotations

import torch

from engine.config.model import ModelConfig
from engine.layers.indexer import Indexer
from engine.layers.mla import SparseMLAAttention
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3DecoderLayer,
    DeepseekV3ForCausalLM,
    DeepseekV3Model,
    DeepseekV3MTP,
    softmax_scale,
)


class DeepseekV32Attention(DeepseekV3Attention):
    """V3's MLA projections (queries always low-rank), the indexer, and MLA over
    the positions it chose."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__(cfg, rotary_emb)
        mla, dsa = cfg.mla, cfg.dsa
        if dsa is None or mla.q_lora_rank is None:
            raise ValueError(
                "DeepseekV32Attention needs the config's DSA settings and a q_lora_rank"
            )
        self.attn = SparseMLAAttention(
            self.num_heads,
            mla.kv_lora_rank,
            self.nope_dim,
            self.rope_dim,
            mla.v_head_dim,
            softmax_scale(cfg),
            dsa.index_head_dim,
        )
        self.indexer = Indexer(
            cfg.hidden_size,
            mla.q_lora_rank,
            dsa.index_n_heads,
            dsa.index_head_dim,
            self.rope_dim,
            dsa.index_topk,
            rotary_emb,
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q_latent = self.q_a_layernorm(self.q_a_proj(x))
        chosen = self.indexer(positions, x, q_latent, self.attn.kv_cache)
        return self.attend(positions, x, self.q_b_proj(q_latent), chosen)


class DeepseekV32DecoderLayer(DeepseekV3DecoderLayer):
    attention_class = DeepseekV32Attention


class DeepseekV32MTP(DeepseekV3MTP):
    attention_class = DeepseekV32Attention


class DeepseekV32Model(DeepseekV3Model):
    layer_class = DeepseekV32DecoderLayer
    mtp_class = DeepseekV32MTP


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    model_class = DeepseekV32Model
    supports_compile = False  # the indexer's chosen positions have no opaque operator yet
