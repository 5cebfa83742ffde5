"""Verifying sampled drafts without changing the distribution (Leviathan et al.
2023, Chen et al. 2023).

A draft x drawn from q is accepted with probability min(1, p(x) / q(x)), p the
target's distribution at its position after the request's filters; the first
rejected one is replaced by a token drawn from max(0, p - q), normalised; when
every draft is accepted, the token after them comes from p. Each output token
is then distributed as p, whatever q is: q only decides how many are accepted.

A deterministic proposer's q is one-hot at x, so acceptance is p(x) and the
residual is p without x. The model runner does not come here for those: it
draws the position's token from p as it would without drafts and accepts x
when they are equal, which is the same rule, realised with the very draws of
decoding without drafts (so a seeded request's tokens do not change). Greedy
requests never come here either: their p is one-hot at the argmax, so the rule
is the strict match.

The random draws are the request's own stream, at each draft's output position
(sample/sampler.py), on token ids no vocabulary reaches, so that they are
independent of that position's ordinary draw and of each other."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sample.sampler import RandomRows, apply_filters, argmax, exponential_noise


@dataclass
class DraftCheck:
    """On the device: the drafts of each request that sampled, padded with -1
    (which no sampled token equals), and the row of the token sampled before each."""

    drafts: torch.Tensor  # [requests, max drafts] int64
    rows: torch.Tensor  # [requests, max drafts] int64 indices into the sampled tokens
    # The sampled requests whose drafts carry q: the rejection sampler's.
    sampled: SampledDrafts | None = None

    def num_accepted(self, sampled: torch.Tensor) -> torch.Tensor:
        """Strict match, left to right: drafts accepted until the first that differs
        from the token sampled at its position."""
        match = sampled[self.rows] == self.drafts
        return match.long().cumprod(dim=1).sum(dim=1)


@dataclass
class SampledDrafts:
    """The drafts of the step's sampled requests whose proposer gave q, on the device."""

    index: torch.Tensor  # [R] int64: which of the step's drafting requests (DraftCheck rows)
    rows: torch.Tensor  # [R, K] int64: the logits row of each draft's position (padding repeats)
    drafts: torch.Tensor  # [R, K] int64, padded with 0
    num_drafts: torch.Tensor  # [R] int64
    probs: torch.Tensor  # [R, K, vocab] float32 q, padded with zeros
    filters: RandomRows  # the R * K positions' settings and streams, row-major


def target_probs(logits: torch.Tensor, r: RandomRows) -> torch.Tensor:
    """p over the whole vocabulary: the rows' logits after temperature, top-k,
    top-p and min-p, as the sampler's draw sees them."""
    filtered, ids = apply_filters(logits, r)
    probs = filtered.softmax(dim=-1)
    if ids is None:
        return probs
    return torch.zeros_like(logits).scatter_(1, ids, probs)


def rejection_sample(
    p: torch.Tensor,
    q: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The math, on tensors: p and q are [R, K, V], drafts [R, K], num_drafts
    [R], uniform [R, K] on (0, 1), noise [R, K, V] Exp(1). Returns how many
    drafts each request accepts ([R]) and, at every position, the token that
    replaces its draft if that is the first rejected ([R, K])."""
    px = p.gather(2, drafts[..., None]).squeeze(2)
    qx = q.gather(2, drafts[..., None]).squeeze(2)
    ok = uniform * qx < px  # probability min(1, p(x) / q(x))
    ok &= torch.arange(drafts.shape[1], device=drafts.device) < num_drafts[:, None]
    accepted = ok.long().cumprod(dim=1).sum(dim=1)
    residual = (p - q).clamp_(min=0.0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0  # p == q there: rounding alone rejects
    residual = torch.where(empty, p, residual)
    recovered = argmax(residual.div_(noise))  # the exponential race, unnormalised
    return accepted, recovered


def draws(r: RandomRows, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each position's acceptance uniform ([n]) and residual race noise ([n, V]),
    from its request's stream at its output position, on ids past the vocabulary."""
    n = r.seeds.shape[0]
    uniform_id = torch.full((n, 1), 2 * vocab_size, dtype=torch.int64, device=r.seeds.device)
    uniform = exponential_noise(r.seeds, r.steps, uniform_id, vocab_size).neg_().exp_()
    ids = torch.arange(vocab_size, 2 * vocab_size, device=r.seeds.device).expand(n, -1)
    return uniform.squeeze(1), exponential_noise(r.seeds, r.steps, ids, vocab_size)


def verify_sampled(
    logits: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor, sd: SampledDrafts
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sample the requests of ``sd``: ``tokens`` (a token per logits row)
    and ``accepted`` (per drafting request, by strict match) with theirs replaced.
    Accepted drafts take their rows, the first rejected its residual token; the
    row after the last draft keeps its ordinary draw from p, the bonus token."""
    num, width = sd.drafts.shape
    vocab = logits.shape[-1]
    p = target_probs(logits[sd.rows.flatten()], sd.filters).view(num, width, vocab)
    uniform, noise = draws(sd.filters, vocab)
    acc, recovered = rejection_sample(
        p, sd.probs, sd.drafts, sd.num_drafts, uniform.view(num, width), noise.view(p.shape)
    )
    tokens, accepted = tokens.clone(), accepted.clone()
    accepted[sd.index] = acc
    column = torch.arange(width, device=tokens.device)
    keep = column < acc[:, None]
    tokens[sd.rows[keep]] = sd.drafts[keep]
    replaced = (column == acc[:, None]) & (column < sd.num_drafts[:, None])
    tokens[sd.rows[replaced]] = recovered[replaced]
    return tokens, accepted
