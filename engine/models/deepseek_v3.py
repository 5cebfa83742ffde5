"""DeepSeek-V3: multi-head latent attention, dense layers then mixture-of-experts
layers, and multi-token prediction (MTP) modules after the last layer.

The checkpoint is read as transformers saves it: one tensor per expert (packed
here into one stacked parameter per layer), and the MTP modules at layer index
num_hidden_layers and up, as DeepSeek stores them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from engine.config.model import ModelConfig
from engine.layers.gate import GroupedTopKRouter
from engine.layers.layernorm import RMSNorm
from engine.layers.mla import MLAAttention
from engine.layers.moe import Experts, GatedMLP, MoE
from engine.layers.rotary_embedding import RotaryEmbedding, yarn_mscale
from engine.models.base import CausalLM, DecoderLayer, check_complete, copy_checked, never_loaded

if TYPE_CHECKING:
    from engine.kv.kv_cache import CachedLayer

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not the config's


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale squared when mscale_all_dim asks for it:
    DeepSeek moves that part of YaRN's temperature from cos/sin into the softmax."""
    mla = cfg.mla
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    rope = cfg.rope_scaling
    if rope is not None and rope.get("mscale_all_dim"):
        scale *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


class DeepseekV3Attention(nn.Module):
    """MLA's projections: queries (low-rank or direct), the latent and the rotary key,
    and the output; the cache and the attention itself are MLAAttention's."""

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding) -> None:
        super().__init__()
        mla, width, bias = cfg.mla, cfg.hidden_size, cfg.attention_bias
        self.num_heads = cfg.num_attention_heads
        self.nope_dim, self.rope_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.kv_lora_rank = mla.kv_lora_rank
        q_size = self.num_heads * (self.nope_dim + self.rope_dim)
        if mla.q_lora_rank is None:
            self.q_proj = nn.Linear(width, q_size, bias=False)
        else:
            self.q_a_proj = nn.Linear(width, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, q_size, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, mla.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, self.num_heads * (self.nope_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * mla.v_head_dim, width, bias=bias)
        self.rotary_emb = rotary_emb
        self.attn = MLAAttention(
            self.num_heads,
            mla.kv_lora_rank,
            self.nope_dim,
            self.rope_dim,
            mla.v_head_dim,
            softmax_scale(cfg),
        )

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return self.attend(positions, x, q)

    def attend(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        q: torch.Tensor,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """MLA from the queries q [tokens, heads * (nope + rope)] on; ``chosen``, the
        positions each query attends to (DeepSeek-V3.2), or None for all."""
        q_nope, q_rope = q.view(len(x), self.num_heads, -1).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        q_rope, k_rope = self.rotary_emb(positions, q_rope, k_rope[:, None])
        o = self.attn(q_nope, q_rope, latent, k_rope[:, 0], self.kv_b_proj.weight, chosen)
        return self.o_proj(o.flatten(1))


class DeepseekV3DecoderLayer(DecoderLayer):
    attention_class: ClassVar[type[DeepseekV3Attention]] = DeepseekV3Attention

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.self_attn = self.attention_class(cfg, rotary_emb)
        moe = cfg.moe
        if index >= moe.first_k_dense_replace:
            gate = GroupedTopKRouter(
                cfg.hidden_size,
                moe.num_experts,
                moe.top_k,
                moe.num_groups,
                moe.topk_groups,
                moe.norm_topk_prob,
                moe.routed_scaling_factor,
            )
            self.mlp = MoE(cfg.hidden_size, moe.intermediate_size, moe.num_shared_experts, gate)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SharedHead(nn.Module):
    """The MTP module's final norm; its output head is the main model's lm_head."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV3MTP(DeepseekV3DecoderLayer):
    """A multi-token prediction module: a decoder layer (stored as layer
    num_hidden_layers + k, with that layer's names) and the parts around it.

    Given the main model's final hidden state h_i at position i and the token t_{i+1},
    it predicts t_{i+2}: the decoder layer runs over eh_proj([enorm(emb(t_{i+1})),
    hnorm(h_i)]) at position i, and shared_head.norm then the main model's output
    head give the logits. (The V3 report writes the concatenation hidden first; the
    released eh_proj weights take the embedding first.)
    """

    def __init__(self, cfg: ModelConfig, rotary_emb: RotaryEmbedding, index: int) -> None:
        super().__init__(cfg, rotary_emb, index)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.shared_head = SharedHead(cfg)

    def predict(
        self, positions: torch.Tensor, hidden: torch.Tensor, next_embeds: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The normalised hidden state that the output head turns into t_{i+2}'s
        logits, and the module's output before that norm: what a second drafting
        step takes as its h (engine/spec_decode/mtp.py), as vLLM's does."""
        x = self.eh_proj(torch.cat([self.enorm(next_embeds), self.hnorm(hidden)], dim=-1))
        x, residual = self.forward(positions, x, None)
        return self.shared_head.norm(x, residual)


class DeepseekV3Model(nn.Module):
    layer_class: ClassVar[type[DeepseekV3DecoderLayer]] = DeepseekV3DecoderLayer
    mtp_class: ClassVar[type[DeepseekV3MTP]] = DeepseekV3MTP

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        rope = RotaryEmbedding(
            cfg.mla.qk_rope_head_dim,
            cfg.max_position_embeddings,
            cfg.rope_theta,
            cfg.rope_scaling,
            interleaved=cfg.mla.rope_interleave,
        )
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(self.layer_class(cfg, rope, i) for i in range(n))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mtp = nn.ModuleList(
            self.mtp_class(cfg, rope, n + k) for k in range(cfg.num_mtp_layers)
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, residual = layer(positions, x, residual)
        x, _ = self.norm(x, residual)
        return x


class DeepseekV3ForCausalLM(CausalLM):
    # The MoE layers size each expert's matmul from the routing, on the host: a
    # decode step cannot be captured in a CUDA graph. torch.compile calls them as
    # opaque operators, and MLA's attention too (runner/compiled_decode.py).
    supports_cuda_graphs = False
    supports_compile = True
    model_class: ClassVar[type[DeepseekV3Model]] = DeepseekV3Model
    plain_linears = ("kv_b_proj",)  # MLA absorbs its weight into queries and outputs

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def mtp_logits(
        self, positions: torch.Tensor, hidden: torch.Tensor, next_token_ids: torch.Tensor
    ) -> torch.Tensor:
        """Logits of token i+2 for each row: from the main model's final hidden state
        at position i and token i+1, through the first MTP module (DeepSeek-V3 ships
        one). Runs under forward_context, as the model does: the module's attention
        stores these rows in its own paged cache and attends over the rows of the
        same sequence it stored before."""
        return self.lm_head(self.mtp_hidden_states(positions, hidden, next_token_ids)[0])

    def mtp_hidden_states(
        self, positions: torch.Tensor, hidden: torch.Tensor, next_token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What mtp_logits computes before the head, for every row: the normalised
        state (compute_logits of it are the logits) and the state before the norm,
        so that a drafter turns only the rows it drafts from into logits."""
        embeds = self.model.embed_tokens(next_token_ids)
        return self.model.mtp[0].predict(positions, hidden, embeds)

    def attention_layers(self) -> list[MLAAttention]:
        """The main layers' attention, each with a paged cache. The MTP modules'
        get blocks only from something that drafts with them (mtp_attention_layers)."""
        return [layer.self_attn.attn for layer in self.model.layers]

    def has_mtp(self) -> bool:
        return len(self.model.mtp) > 0

    def mtp_attention_layers(self) -> list[CachedLayer]:
        """The MTP modules' attention: each needs a paged cache of its own to draft."""
        return [layer.self_attn.attn for layer in self.model.mtp]

    def moe_layers(self) -> list[MoE]:
        """Every MoE layer, main layers first, then the MTP modules'."""
        layers = (*self.model.layers, *self.model.mtp)
        return [layer.mlp for layer in layers if isinstance(layer.mlp, MoE)]

    def experts(self) -> list[Experts]:
        """The routed experts of every MoE layer, main layers first."""
        return [moe.experts for moe in self.moe_layers()]

    def place_experts(self, local: list[list[int]]) -> None:
        """Hold, in each MoE layer, only the slots this rank serves: local[layer] is
        the logical expert of each. Their weights must be loaded next."""
        for experts, slots in zip(self.experts(), local, strict=True):
            experts.place(slots)

    def wants_weight(self, name: str) -> bool:
        """False for a routed expert's tensor that no slot of this rank holds, so
        that the loader never reads it."""
        target, expert = self._expert(name)
        if expert is None:
            return True
        return bool(self.get_submodule(target.rsplit(".", 1)[0]).slots_of(expert[0]))

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], only_experts: bool = False
    ) -> None:
        """Copy checkpoint tensors in, and prove every element of every parameter was
        (with ``only_experts``, of every routed expert's parameter: a new placement)."""
        params = dict(self.named_parameters())
        if only_experts:
            params = {n: p for n, p in params.items() if ".experts." in n}
        filled = dict.fromkeys(params, 0)
        shared: dict[str, torch.Tensor] = {}
        for name, tensor in weights:
            if never_loaded(name, self.config.tie_word_embeddings):
                continue
            target, expert = self._expert(name)
            if expert is not None:  # into each slot that holds a copy of the expert
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} matches no parameter")
                filled[target] += self._load_expert(target, expert, tensor)
                continue
            if only_experts:
                continue
            target, part = self._target(name)
            if target.startswith("model.mtp.") and target.endswith(
                (".embed_tokens.weight", ".shared_head.head.weight")
            ):
                shared[name] = tensor  # an MTP module's copy of the main model's
                continue
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
            dest = part(params[target].data)
            copy_checked(name, dest, tensor)
            filled[target] += dest.numel()
        check_complete(sorted(n for n, p in params.items() if filled[n] != p.numel()))
        self._check_shared(shared)

    def weight_target(self, name: str) -> str:
        target, expert = self._expert(name)
        return target if expert is not None else self._target(name)[0]

    def _expert(self, name: str) -> tuple[str, tuple[int, str] | None]:
        """For one routed expert's matrix: our stacked parameter, and (expert, proj)."""
        name = self._renamed(name)
        expert = re.search(r"\.experts\.(\d+)\.(gate|up|down)_proj\.weight(_scale_inv)?$", name)
        if not expert:
            return name, None
        proj = expert[2]
        stacked = ("down_proj" if proj == "down" else "gate_up_proj") + (expert[3] or "")
        return f"{name[: expert.start()]}.experts.{stacked}", (int(expert[1]), proj)

    def _load_expert(self, target: str, expert: tuple[int, str], tensor: torch.Tensor) -> int:
        """Copy one expert's matrix into each local slot that holds the expert."""
        module, stacked = target.rsplit(".", 1)
        experts = self.get_submodule(module)
        e, proj = expert
        filled = 0
        for slot in experts.slots_of(e):
            dest = _half(getattr(experts, stacked).data[slot], proj)
            copy_checked(f"expert {e} {proj}_proj", dest, tensor)
            filled += dest.numel()
        return filled

    def _renamed(self, name: str) -> str:
        """MTP modules are stored as layers num_hidden_layers and up; ours are model.mtp."""
        n = self.config.num_hidden_layers
        layer = re.match(r"model\.layers\.(\d+)\.(.*)", name)
        if layer and int(layer[1]) >= n:
            return f"model.mtp.{int(layer[1]) - n}.{layer[2]}"
        return name

    def _target(self, name: str) -> tuple[str, Callable[[torch.Tensor], torch.Tensor]]:
        """Our parameter for a checkpoint tensor, and the part of it the tensor fills."""
        name = self._renamed(name)
        mlp = re.search(r"\.(gate|up)_proj\.weight(_scale_inv)?$", name)
        if mlp:  # a dense MLP's or the shared experts': half of the fused gate_up_proj
            proj = mlp[1]
            return name.replace(f".{proj}_proj.", ".gate_up_proj."), lambda p: _half(p, proj)
        return name, lambda p: p

    def _check_shared(self, shared: dict[str, torch.Tensor]) -> None:
        """DeepSeek's checkpoints repeat the embedding and the head in each MTP layer;
        the engine shares the main model's, so the copies must be equal to them."""
        for name, tensor in shared.items():
            main = self.model.embed_tokens if "embed_tokens" in name else self.lm_head
            if not torch.equal(tensor.to(main.weight), main.weight):
                raise ValueError(f"{name} differs from the main model's, which the engine shares")


def _half(param: torch.Tensor, proj: str) -> torch.Tensor:
    """gate_proj fills the first half of gate_up_proj's rows, up_proj the second;
    down_proj has a stacked parameter to itself."""
    if proj == "down":
        return param
    rows = param.shape[0] // 2
    return param.narrow(0, 0 if proj == "gate" else rows, rows)
