"""DeepSeek-V4: shared-KV attention over a sliding window and compressed rows
(engine/layers/v4_attention.py), hyper-connected residual streams
(engine/layers/hyper_connection.py), and MoE in every layer, hash-routed or
top-k (engine/layers/v4_moe.py).

Weights are read by DeepSeek's own names (layers.N.attn.wq_a, .ffn.experts.E.w1,
hc_head_fn, embed, head), with or without a leading ``model.``, which is what
transformers' save_pretrained writes too. The MTP module's tensors (``mtp.0.``),
which transformers neither builds nor saves, load into DeepseekV4MTP when the
checkpoint has them (ModelConfig.num_mtp_layers), to draft with
(engine/spec_decode/mtp.py); without them, the model has no MTP module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.config.deepseek_v4 import HASH_MOE, V4Config
from engine.config.model import ModelConfig
from engine.kv.compressed_cache import CompressedCacheLayers, CompressedLayer
from engine.layers.hyper_connection import HyperConnection, HyperHead
from engine.layers.moe import Experts
from engine.layers.v4_attention import V4Attention
from engine.layers.v4_moe import V4MoE, V4Router
from engine.layers.v4_norm import Float32RMSNorm
from engine.models.base import CausalLM, check_complete, copy_checked
from engine.models.deepseek_v4_names import Target, target

if TYPE_CHECKING:
    from engine.kv.kv_cache import CachedLayer


class DeepseekV4DecoderLayer(nn.Module):
    """attn and ffn, each between a collapse and an expansion of the streams."""

    def __init__(self, cfg: ModelConfig, v4: V4Config, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn = V4Attention(cfg, index)
        hashed = v4.mlp_layer_types[index] == HASH_MOE
        gate = V4Router(
            hidden,
            v4.num_experts,
            v4.top_k,
            v4.scoring_func,
            v4.routed_scaling_factor,
            cfg.vocab_size if hashed else None,
        )
        self.ffn = V4MoE(hidden, v4.moe_intermediate_size, gate, v4.swiglu_limit)
        self.attn_norm = Float32RMSNorm(hidden, eps)
        self.ffn_norm = Float32RMSNorm(hidden, eps)
        hc = (v4.hc_mult, hidden, v4.hc_sinkhorn_iters, v4.hc_eps, eps)
        self.hc_attn, self.hc_ffn = HyperConnection(*hc), HyperConnection(*hc)

    def forward(
        self, positions: torch.Tensor, streams: torch.Tensor, input_ids: torch.Tensor
    ) -> torch.Tensor:
        """streams [tokens, hc_mult, hidden] -> the same, after this layer."""
        pre, post, comb = self.hc_attn.weights(streams)
        out = self.attn(positions, self.attn_norm(self.hc_attn.collapse(streams, pre)))
        streams = HyperConnection.expand(streams, out, post, comb)
        pre, post, comb = self.hc_ffn.weights(streams)
        out = self.ffn(self.ffn_norm(self.hc_ffn.collapse(streams, pre)), input_ids)
        return HyperConnection.expand(streams, out, post, comb)


class DeepseekV4MTP(DeepseekV4DecoderLayer):
    """DeepSeek-V4's multi-token prediction module (checkpoint names mtp.N.*): from
    the main model's last streams at position i and token i+1, the streams whose
    logits are token i+2's. Each input is normed (hnorm per stream, enorm) and
    projected (h_proj, e_proj; the token's projection is added to every stream),
    then one whole V4 layer runs, a sliding window and top-k MoE
    (V4Config.with_mtp_layer), and the module's own hyper-head and norm collapse
    the streams for the model's head. The embedding and head are the model's."""

    def __init__(self, cfg: ModelConfig, v4: V4Config, index: int) -> None:
        super().__init__(replace(cfg, v4=v4), v4, index)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm, self.hnorm = Float32RMSNorm(hidden, eps), Float32RMSNorm(hidden, eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.hc_head = HyperHead(v4.hc_mult, hidden, v4.hc_eps, eps)
        self.norm = Float32RMSNorm(hidden, eps)

    def predict(
        self,
        positions: torch.Tensor,
        streams: torch.Tensor,
        next_token_ids: torch.Tensor,
        next_embeds: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """streams [tokens, hc_mult, hidden] -> the normed state the head turns into
        logits, and the module's output streams (what a further draft starts from)."""
        x = self.e_proj(self.enorm(next_embeds))[:, None] + self.h_proj(self.hnorm(streams))
        x = self(positions, x, next_token_ids)
        return self.norm(self.hc_head(x)), x


class DeepseekV4ForCausalLM(CausalLM):
    supports_cuda_graphs = False  # experts sized on the host, attention per sequence
    reads_block_holes = True  # holes where its window gave blocks back, and row blocks
    unquantized_linears = ("head", "wo_a")  # by int8 and int4 (base.py)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        v4 = cfg.v4
        if v4 is None:
            raise ValueError("DeepseekV4ForCausalLM needs the config's DeepSeek-V4 fields")
        self.config, self.v4 = cfg, v4
        hidden = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(
            DeepseekV4DecoderLayer(cfg, v4, i) for i in range(cfg.num_hidden_layers)
        )
        self.hc_head = HyperHead(v4.hc_mult, hidden, v4.hc_eps, cfg.rms_norm_eps)
        self.norm = Float32RMSNorm(hidden, cfg.rms_norm_eps)
        self.head = nn.Linear(hidden, cfg.vocab_size, bias=False)
        n, mtp = cfg.num_hidden_layers, v4.with_mtp_layer()
        self.mtp = nn.ModuleList(DeepseekV4MTP(cfg, mtp, n) for _ in range(cfg.num_mtp_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The last layer's streams, flattened to [tokens, hc_mult * hidden]: an MTP
        module starts from them, and compute_logits collapses them."""
        x = self.embed(input_ids)
        streams = x[:, None, :].expand(-1, self.v4.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(positions, streams, input_ids)
        return streams.flatten(1)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        streams = hidden.unflatten(-1, (self.v4.hc_mult, -1))
        return self.head(self.norm(self.hc_head(streams)))

    def has_mtp(self) -> bool:
        return len(self.mtp) > 0

    def mtp_hidden_states(
        self, positions: torch.Tensor, hidden: torch.Tensor, next_token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP module over rows of (the main streams at i, token i+1): its normed
        state (draft_logits of it are token i+2's logits) and its output streams,
        flattened as forward's are."""
        streams = hidden.unflatten(-1, (self.v4.hc_mult, -1))
        embeds = self.embed(next_token_ids)
        normed, out = self.mtp[0].predict(positions, streams, next_token_ids, embeds)
        return normed, out.flatten(1)

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return self.head(normed)

    def attention_layers(self) -> list[V4Attention]:
        return [layer.attn for layer in self.layers]

    def kv_cache_layers(self, block_size: int) -> list[CachedLayer]:
        """Every layer's cache as one, in pages a token block or a row block fills
        (engine/kv/compressed_cache.py)."""
        layers: list[CompressedLayer] = list(self.attention_layers())
        return [CompressedCacheLayers(layers, self.v4.row_span(block_size))]

    def mtp_attention_layers(self) -> list[CachedLayer]:
        """The MTP module's sliding window, as a cache of its own in the pool: token
        blocks only, at the main cache's block ids."""
        layers: list[CompressedLayer] = [module.attn for module in self.mtp]
        return [CompressedCacheLayers(layers, 0)] if layers else []

    def moe_layers(self) -> list[V4MoE]:
        """Every layer's MoE, hash-routed and top-k alike, in layer order, then the
        MTP module's."""
        return [layer.ffn for layer in (*self.layers, *self.mtp)]

    def experts(self) -> list[Experts]:
        return [moe.experts for moe in self.moe_layers()]

    def place_experts(self, local: list[list[int]]) -> None:
        """Hold, in each layer, only the slots this rank serves: local[layer] is the
        logical expert of each. Their weights must be loaded next."""
        for experts, slots in zip(self.experts(), local, strict=True):
            experts.place(slots)

    def wants_weight(self, name: str) -> bool:
        """False for a routed expert's tensor no slot of this rank holds (and for
        what is never loaded), so that the loader never reads it."""
        where = self._target(name)
        if where is None or where.expert is None:
            return where is not None
        return bool(self.get_submodule(where.param.rsplit(".", 1)[0]).slots_of(where.expert))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], only_experts: bool = False
    ) -> None:
        """Copy every tensor in by its DeepSeek name (deepseek_v4_names.py), a routed
        expert's into each slot that holds a copy of it, and prove every parameter
        was filled (with ``only_experts``, every routed expert's: a new placement)."""
        params = dict(self.named_parameters())
        if only_experts:
            params = {n: p for n, p in params.items() if ".experts." in n}
        filled = dict.fromkeys(params, 0)
        for name, tensor in weights:
            where = self._target(name)
            if where is None or (only_experts and where.expert is None):
                continue
            if where.param not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            for dest in self._destinations(where, params[where.param].data):
                copy_checked(name, dest, tensor)
                filled[where.param] += dest.numel()
        check_complete(sorted(n for n, p in params.items() if filled[n] != p.numel()))

    def weight_target(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills (None: one the model does not
        load), which the quantized checkpoints' loader asks for."""
        where = self._target(name)
        return None if where is None else where.param

    def _target(self, name: str) -> Target | None:
        """Where a checkpoint tensor goes; None for an MTP tensor when the model has
        no MTP module (ModelConfig.num_mtp_layers says why)."""
        where = target(name)
        if where is not None and where.param.startswith("mtp.") and not self.mtp:
            return None
        return where

    def _destinations(self, where: Target, data: torch.Tensor) -> list[torch.Tensor]:
        """The parts of ``data`` one checkpoint tensor fills: for a routed expert,
        its part of every slot holding a copy (none on a rank that holds none)."""
        if where.expert is None:
            return [where.view(data)]
        experts = self.get_submodule(where.param.rsplit(".", 1)[0])
        return [where._replace(expert=s).view(data) for s in experts.slots_of(where.expert)]
