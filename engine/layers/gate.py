"""DeepSeek-V3's MoE gate (its router): which experts each token goes to, and with what weight.

Scores are sigmoids, one per expert. A per-expert bias, learned during training
by auxiliary-loss-free balancing, steers the *choice* towards underused experts
but never enters the weights. The choice is limited to a few groups of experts
(in DeepSeek-V3 a group is one node), so each token's experts sit on few nodes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class GroupedTopKRouter(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        if num_experts % num_groups:
            raise ValueError(f"n_routed_experts {num_experts} is not divisible by n_group")
        if top_k > topk_groups * (num_experts // num_groups):
            raise ValueError("num_experts_per_tok exceeds the experts of topk_group groups")
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor
        # Float32 whatever the model's dtype, as DeepSeek keeps them: a rounded
        # score can flip which expert wins.
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(num_experts, dtype=torch.float32), requires_grad=False
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (weights, expert ids), each [tokens, top_k]."""
        # Float32 at least; float64 in a float64 model, where it makes routing the same
        # on every CPU (snippets/ch04/demo_expert_load.py).
        dtype = torch.promote_types(x.dtype, torch.float32)
        scores = F.linear(x.to(dtype), self.weight.to(dtype)).sigmoid()
        biased = scores + self.e_score_correction_bias  # for choosing only
        # A group's score is the sum of its two best experts; keep the best groups.
        groups = biased.view(len(x), self.num_groups, self.num_experts // self.num_groups)
        group_scores = groups.topk(2, dim=-1).values.sum(-1)
        best = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
        ids = biased.topk(self.top_k, dim=-1, sorted=False).indices
        # The weights come from the unbiased scores of the chosen experts.
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids
