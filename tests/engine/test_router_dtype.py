"""The MoE router's contract beyond its arithmetic: it scores in float32 at
least, whatever the model's dtype (a rounded score can flip which expert wins),
and a config it cannot route says why, naming the fields to change."""

from __future__ import annotations

import pytest
import torch

from engine.layers.gate import GroupedTopKRouter


def router(**kw: object) -> GroupedTopKRouter:
    args = {
        "hidden_size": 32,
        "num_experts": 16,
        "top_k": 4,
        "num_groups": 4,
        "topk_groups": 2,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
    }
    r = GroupedTopKRouter(**(args | kw))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        r.weight.normal_(0, 0.3, generator=g)
        r.e_score_correction_bias.normal_(0, 0.1, generator=g)
    return r


def test_a_bfloat16_model_routes_as_float32_routes_the_same_values() -> None:
    """Hidden states in bfloat16 are scored in float32: the same values given in
    float32 get bit-identical weights and the same experts, and the weights come
    back in float32."""
    r = router()
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1)).bfloat16()
    weights, ids = r(x)
    want_weights, want_ids = r(x.float())
    assert weights.dtype == torch.float32
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"num_experts": 15}, "n_routed_experts 15 is not divisible by n_group"),
        ({"top_k": 9}, "num_experts_per_tok exceeds the experts of topk_group groups"),
    ],
)
def test_a_config_the_router_cannot_route_names_its_fields(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        router(**kw)
