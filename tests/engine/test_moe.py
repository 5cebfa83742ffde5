"""DeepSeek-V3's router and dropless MoE layer against transformers' modules,
on fresh random inputs, including exact ties between groups."""

from __future__ import annotations

import pytest
import torch

from engine.layers.gate import GroupedTopKRouter
from engine.layers.moe import MoE

HIDDEN, INTER = 32, 16


def hf_config(
    n_group: int,
    topk_group: int,
    top_k: int,
    experts: int = 16,
    norm_topk_prob: bool = True,
    routed_scaling_factor: float = 2.5,
):
    import transformers

    return transformers.DeepseekV3Config(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        n_shared_experts=1,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
    )


def engine_router(cfg) -> GroupedTopKRouter:
    return GroupedTopKRouter(
        cfg.hidden_size,
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.n_group,
        cfg.topk_group,
        cfg.norm_topk_prob,
        cfg.routed_scaling_factor,
    )


def routers(n_group: int, topk_group: int, top_k: int, seed: int):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    torch.manual_seed(seed)
    cfg = hf_config(n_group, topk_group, top_k)
    hf = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        hf.weight.normal_(0, 0.5)
        hf.e_score_correction_bias.normal_(0, 0.1)  # zero in a fresh model: make it count
    ours = engine_router(cfg)
    ours.load_state_dict(hf.state_dict())
    return hf, ours


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, experts] with each token's weight at its chosen experts, 0 elsewhere:
    the same routing whatever order topk returned the experts in."""
    return torch.zeros(len(ids), 16).scatter_(1, ids, weights)


@pytest.mark.parametrize(("n_group", "topk_group", "top_k"), [(4, 2, 4), (1, 1, 4), (8, 3, 6)])
def test_router_matches_transformers(n_group: int, topk_group: int, top_k: int) -> None:
    hf, ours = routers(n_group, topk_group, top_k, seed=n_group)
    x = torch.randn(64, HIDDEN)
    _, hf_w, hf_ids = hf(x)
    w, ids = ours(x)
    assert torch.equal(hf_ids.sort(-1).values, ids.sort(-1).values)
    torch.testing.assert_close(by_expert(w, ids), by_expert(hf_w, hf_ids), rtol=1e-6, atol=1e-7)
    assert torch.allclose(w.sum(-1), torch.full((64,), 2.5))  # normalised, then scaled


def test_router_bias_steers_choice_but_not_weights() -> None:
    hf, ours = routers(4, 2, 4, seed=0)
    x = torch.randn(32, HIDDEN)
    _, ids = ours(x)
    with torch.no_grad():
        ours.e_score_correction_bias.zero_()
        ours.e_score_correction_bias[0] = 10.0  # expert 0 now always wins its place
    w, biased_ids = ours(x)
    assert (biased_ids == 0).any(-1).all() and not (ids == 0).any(-1).all()
    scores = torch.sigmoid(x @ ours.weight.T)
    chosen = scores.gather(1, biased_ids)
    torch.testing.assert_close(w, 2.5 * chosen / chosen.sum(-1, keepdim=True))


def test_router_ties_between_groups_resolve_as_transformers() -> None:
    """Groups 0 and 2, and 1 and 3, score exactly alike for every token, so each
    group choice is a tie; both routers must break it the same way."""
    hf, ours = routers(4, 1, 2, seed=3)
    with torch.no_grad():
        for w in (hf.weight, ours.weight):
            w[8:12] = w[0:4]
            w[12:16] = w[4:8]
        for b in (hf.e_score_correction_bias, ours.e_score_correction_bias):
            b[8:12] = b[0:4]
            b[12:16] = b[4:8]
    x = torch.randn(128, HIDDEN)
    _, hf_w, hf_ids = hf(x)
    w, ids = ours(x)
    biased = torch.sigmoid(x @ ours.weight.T) + ours.e_score_correction_bias
    group_scores = biased.view(-1, 4, 4).topk(2, dim=-1).values.sum(-1)
    assert torch.equal(group_scores[:, :2], group_scores[:, 2:])  # every choice is a tie
    assert set((ids // 4).flatten().tolist()) == {0, 1}  # the lower of each tied pair
    assert torch.equal(hf_ids.sort(-1).values, ids.sort(-1).values)
    torch.testing.assert_close(by_expert(w, ids), by_expert(hf_w, hf_ids))


def test_moe_matches_transformers_and_counts_tokens() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(1)
    cfg = hf_config(4, 2, 4)
    hf = DeepseekV3MoE(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.1)
    ours = MoE(HIDDEN, INTER, cfg.n_shared_experts, engine_router(cfg))
    with torch.no_grad():
        ours.gate.load_state_dict(hf.gate.state_dict())
        ours.experts.gate_up_proj.copy_(hf.experts.gate_up_proj)
        ours.experts.down_proj.copy_(hf.experts.down_proj)
        s = hf.shared_experts
        ours.shared_experts.gate_up_proj.weight.copy_(
            torch.cat([s.gate_proj.weight, s.up_proj.weight])
        )
        ours.shared_experts.down_proj.weight.copy_(s.down_proj.weight)
    x = torch.randn(1, 50, HIDDEN)
    with torch.no_grad():
        expected = hf(x)[0]
        got = ours(x[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _, _, ids = hf.gate(x)
    assert torch.equal(ours.experts.token_counts, torch.bincount(ids.flatten(), minlength=16))
    assert ours.experts.token_counts.sum() == 50 * 4
