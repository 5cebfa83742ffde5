"""Manifold-constrained hyper-connections (mHC), DeepSeek-V4's residual stream.

The residual is ``hc_mult`` parallel streams per token, [tokens, N, hidden].
Around each attention or MoE block, a small projection of the (normalised,
flattened) streams gives three things, all in float32:

- pre [tokens, N]: how the streams collapse into the block's one input;
- post [tokens, N]: how the block's output spreads back over the streams;
- comb [tokens, N, N]: how the old streams mix into the new ones,
      new[k] = post[k] * block_out + sum_j comb[j, k] * old[j].

comb is pushed onto the doubly stochastic matrices (rows and columns summing to
1) by Sinkhorn-Knopp: a softmax over rows, then alternately normalise columns
and rows. So mixing the streams never amplifies them. After the last layer the
hyper-head collapses the streams once more, with a pre of its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.v4_norm import unweighted_rms_norm


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., N, N] logits -> a matrix whose rows and columns each sum to 1 within
    about eps: a row softmax (plus eps), then columns and rows normalised in turn,
    ``iters`` normalisations of columns in all."""
    comb = logits.softmax(dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    """One block's mHC weights; checkpoint names hc_{attn,ffn}_{fn,base,scale}."""

    def __init__(self, hc_mult: int, hidden_size: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        n = hc_mult
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32))

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [tokens, N, hidden] -> pre [tokens, N], post [tokens, N] and
        comb [tokens, N, N], in float32."""
        n = self.n
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb_logits = comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n)
        return pre, post, sinkhorn(comb_logits, self.iters, self.eps)

    def collapse(self, streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The block's input [tokens, hidden]: the streams weighted by pre."""
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)

    @staticmethod
    def expand(
        streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
    ) -> torch.Tensor:
        """The new streams: post[k] * out + sum_j comb[j, k] * streams[j]."""
        dtype = streams.dtype
        mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
        return post.to(dtype)[..., None] * out[:, None, :] + mixed


class HyperHead(nn.Module):
    """The final collapse of the streams; checkpoint names hc_head_{fn,base,scale}."""

    def __init__(self, hc_mult: int, hidden_size: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32))
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32))

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre = torch.sigmoid(mixes * self.scale.float() + self.base.float()) + self.eps
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
