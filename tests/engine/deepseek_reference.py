"""DeepSeek-V3's MTP module in float64, written from the technical reports' equations
and read straight from the checkpoint by DeepSeek's tensor names: the yardstick the
engine's MTP module is tested against.

DeepSeek-V3 report (arXiv 2412.19437), section 2.2, MTP module k at position i:
    h'_i = M_k [RMSNorm(h_i); RMSNorm(Emb(t_{i+1}))]      (eq. 21)
    h_i^k = TRM_k(h'_i)                                  (eq. 22, causal over i)
    P_{i+2} = OutHead(h_i^k)                             (eq. 23)
The released eh_proj (M_k) takes the embedding's half first, which is the order used
here; OutHead is shared_head.norm then the main model's output matrix. TRM_k is a
decoder layer: MLA (DeepSeek-V2 report, eqs. 9-19, with the RMSNorms on the two
latents that the checkpoints carry) and DeepSeekMoE (V3 report, eqs. 12-16: sigmoid
affinities, a bias used only to choose, group-limited top-k, weights normalised from
the unbiased affinities, scaled by routed_scaling_factor from the config).

Plain and slow on purpose: one sequence, plain RoPE, rotary pairs rotated where
they sit (interleaved or split halves), every expert applied token by token.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """Rotate pair j of each row of x ([tokens, ..., d]) by position * theta^(-2j/d).
    A pair is (x[2j], x[2j+1]) in DeepSeek's interleaved layout, (x[j], x[j+d/2]) else."""
    d = x.shape[-1]
    pos = torch.arange(x.shape[0], dtype=torch.float64).view(-1, *[1] * (x.dim() - 1))
    angle = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    first, second = (x[..., 0::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
    out = torch.empty_like(x)
    rotated = (
        first * angle.cos() - second * angle.sin(),
        second * angle.cos() + first * angle.sin(),
    )
    if interleaved:
        out[..., 0::2], out[..., 1::2] = rotated
    else:
        out = torch.cat(rotated, dim=-1)
    return out


def mla(x: torch.Tensor, w: dict, cfg) -> torch.Tensor:
    """Causal multi-head latent attention over x [tokens, hidden], expanded."""
    heads, nope, rdim, vdim = (
        cfg.num_attention_heads,
        cfg.qk_nope_head_dim,
        cfg.qk_rope_head_dim,
        cfg.v_head_dim,
    )
    c_q = rms_norm(x @ w["self_attn.q_a_proj.weight"].T, w["self_attn.q_a_layernorm.weight"], 1e-6)
    q = (c_q @ w["self_attn.q_b_proj.weight"].T).view(len(x), heads, nope + rdim)
    q_c, q_r = q[..., :nope], rope(q[..., nope:], cfg.rope_theta, cfg.rope_interleave)
    ckv_kr = x @ w["self_attn.kv_a_proj_with_mqa.weight"].T
    c_kv = rms_norm(ckv_kr[:, : cfg.kv_lora_rank], w["self_attn.kv_a_layernorm.weight"], 1e-6)
    k_r = rope(ckv_kr[:, cfg.kv_lora_rank :], cfg.rope_theta, cfg.rope_interleave)
    kv = (c_kv @ w["self_attn.kv_b_proj.weight"].T).view(len(x), heads, nope + vdim)
    k_c, v = kv[..., :nope], kv[..., nope:]
    scores = torch.einsum("qhd,khd->hqk", q_c, k_c) + torch.einsum("qhd,kd->hqk", q_r, k_r)
    scores = scores / math.sqrt(nope + rdim)
    causal = torch.ones(len(x), len(x), dtype=torch.bool).tril()
    p = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", p, v).flatten(1)
    return o @ w["self_attn.o_proj.weight"].T


def ffn(x: torch.Tensor, w: dict, prefix: str) -> torch.Tensor:
    gate, up = x @ w[f"{prefix}.gate_proj.weight"].T, x @ w[f"{prefix}.up_proj.weight"].T
    return (F.silu(gate) * up) @ w[f"{prefix}.down_proj.weight"].T


def moe(u: torch.Tensor, w: dict, cfg) -> torch.Tensor:
    """Shared experts on every token; each token's routed experts, chosen by group."""
    out = ffn(u, w, "mlp.shared_experts")
    s = torch.sigmoid(u @ w["mlp.gate.weight"].T)  # affinities s_{i,t}
    biased = s + w["mlp.gate.e_score_correction_bias"]
    per_group = cfg.n_routed_experts // cfg.n_group
    for t in range(len(u)):
        groups = biased[t].view(cfg.n_group, per_group)
        group_score = groups.topk(2).values.sum(-1)
        best_groups = sorted(range(cfg.n_group), key=lambda g: (-group_score[g].item(), g))
        allowed = [
            e
            for g in best_groups[: cfg.topk_group]
            for e in range(g * per_group, (g + 1) * per_group)
        ]
        chosen = sorted(allowed, key=lambda e: (-biased[t, e].item(), e))[: cfg.num_experts_per_tok]
        gates = s[t, chosen]
        if cfg.norm_topk_prob:
            gates = gates / gates.sum()
        for g, e in zip(gates * cfg.routed_scaling_factor, chosen):
            out[t] += g * ffn(u[t : t + 1], w, f"mlp.experts.{e}")[0]
    return out


def mtp_logits(
    hidden: torch.Tensor, next_tokens: torch.Tensor, ckpt: dict, cfg, depth: int = 0
) -> torch.Tensor:
    """Logits of t_{i+2} for every i, from the main model's final hidden states h_i
    ([tokens, hidden]) and the tokens t_{i+1}. Tensors of ``ckpt`` by checkpoint name."""
    n = cfg.num_hidden_layers + depth
    w = {
        name.removeprefix(f"model.layers.{n}."): t.double()
        for name, t in ckpt.items()
        if name.startswith(f"model.layers.{n}.")
    }
    eps = cfg.rms_norm_eps
    emb = ckpt["model.embed_tokens.weight"].double()[next_tokens]
    joined = torch.cat(
        [rms_norm(emb, w["enorm.weight"], eps), rms_norm(hidden.double(), w["hnorm.weight"], eps)],
        dim=-1,
    )
    x = joined @ w["eh_proj.weight"].T
    x = x + mla(rms_norm(x, w["input_layernorm.weight"], eps), w, cfg)
    x = x + moe(rms_norm(x, w["post_attention_layernorm.weight"], eps), w, cfg)
    return rms_norm(x, w["shared_head.norm.weight"], eps) @ ckpt["lm_head.weight"].double().T
