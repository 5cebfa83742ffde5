"""Llama, Qwen2 and Qwen3: one decoder, three sets of switches.

The q, k and v projections are fused into one matrix, and so are the MLP's gate
and up projections: one large matmul runs faster than three small ones. The
loader splits a checkpoint's separate tensors into the fused ones.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.layers.activation import SiluAndMul
from engine.layers.attention import Attention
from engine.layers.layernorm import RMSNorm
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.models.base import CausalLM, DecoderLayer, check_complete, copy_checked, never_loaded


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = rotary_emb
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.qk_norm:  # Qwen3
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = self.attn(q, k, v)  # writes k and v to the paged cache, then attends
        return self.o_proj(o.flatten(1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class LlamaDecoderLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, rotary_emb)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, rope) for _ in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """One pass over a flattened batch: input_ids and positions are [tokens].

        Nothing here knows where one sequence ends and the next begins; only
        attention does, through the step's metadata.
        """
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


# Checkpoint tensor -> (our fused parameter, which slice of it).
PACKED_MODULES = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class LlamaForCausalLM(CausalLM):
    supports_compile = True  # its decode step can run through torch.compile
    supports_packed_linears = True  # nothing reads its linear layers' weights directly

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def _slices(self, fused: str) -> list[int]:
        """Row counts of each checkpoint tensor packed into a fused parameter."""
        attn = self.model.layers[0].self_attn
        if fused == "qkv_proj":
            return [attn.q_size, attn.kv_size, attn.kv_size]
        return [self.config.intermediate_size] * 2

    def weight_target(self, name: str) -> str:
        return self._fused(name)[0]

    def _fused(self, name: str) -> tuple[str, int | None]:
        """Our parameter for a checkpoint tensor, and its slice's index if fused."""
        for part, (fused, index) in PACKED_MODULES.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), index
        return name, None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, splitting nothing and missing nothing."""
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = {name: 1 for name in params}
        for fused in ("qkv_proj", "gate_up_proj"):
            for name in params:
                if f".{fused}.weight" in name or f".{fused}.bias" in name:
                    expected[name] = len(self._slices(fused))
        if self.config.tie_word_embeddings:
            expected.pop("lm_head.weight")
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            if never_loaded(name, self.config.tie_word_embeddings):
                continue
            target, shard = self._fused(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            param = params[target]
            if shard is None:
                dest = param.data
            else:
                sizes = self._slices(target.split(".")[-2])
                dest = param.data.narrow(0, sum(sizes[:shard]), sizes[shard])
            copy_checked(name, dest, tensor)
            loaded[target] = loaded.get(target, 0) + 1
        check_complete(sorted(n for n, count in expected.items() if loaded.get(n, 0) != count))
