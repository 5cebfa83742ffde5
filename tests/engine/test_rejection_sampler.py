"""The rejection sampler's math (engine/sample/rejection_sampler.py): over an
8-token vocabulary, with a random target and an unrelated random draft, the
joint distribution of the first three tokens that speculative decoding emits is
the target's own, computed exactly by enumeration; a chi-square test at
alpha = 1e-3 with 60,000 samples. Two wrong samplers fail the same test, which
shows that it has the power to catch a biased one.

The target is a Markov table: the distribution of the token at output position
t depends on t and on the token before it. Drafts are drawn from the draft
table, and checked two at a time, as the engine checks them."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from engine.sample.rejection_sampler import rejection_sample, target_probs
from engine.sample.sampler import RandomRows, SamplingRow
from engine.sampling_params import SamplingParams
from tests.engine.chi_square import chi_square

V = 8
K = 2  # drafts per verify step
N = 60_000  # the wrong samplers miss by ten times the critical value and more
FIRST = V  # the "previous token" index of the first position

Sampler = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def reference_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p after temperature, top-k, then top-p (on the top-k renormalised), then
    min-p, written plainly, one row at a time."""
    rows = []
    for row in logits:
        probs = (row / params.temperature).softmax(-1)
        order = probs.argsort(descending=True)
        keep = torch.zeros(len(row), dtype=torch.bool)
        k = params.top_k if params.top_k > 0 else len(row)
        keep[order[:k]] = True
        head = torch.where(keep, probs, 0.0)
        head /= head.sum()
        mass = 0.0
        for i in order[:k].tolist():
            if mass >= params.top_p:
                keep[i] = False
            mass += head[i].item()
        head = torch.where(keep, probs, 0.0)
        head /= head.sum()
        if params.min_p > 0:
            head = torch.where(head < params.min_p * head.max(), 0.0, head)
        rows.append(head / head.sum())
    return torch.stack(rows)


def tables(params: SamplingParams, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p and draft q, [position 0..3, previous token 0..V, V]: p after the
    filters (the engine's target_probs), q an unrelated full-support table."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(4 * (V + 1), V, generator=g) * 1.5
    rows = [SamplingRow(params, 0, 0)] * logits.shape[0]
    p = target_probs(logits, RandomRows.from_rows(rows, V, torch.device("cpu")))
    assert torch.allclose(p, reference_filter(logits, params), atol=1e-6)
    q = (torch.randn(4 * (V + 1), V, generator=g) * 1.5).softmax(-1)
    return p.view(4, V + 1, V), q.view(4, V + 1, V)


def exact_joint(p: torch.Tensor) -> torch.Tensor:
    """P(t1, t2, t3) by enumeration, flattened to V**3 cells."""
    joint = p[0, FIRST][:, None, None] * p[1, :V][:, :, None] * p[2, :V][None, :, :]
    return joint.flatten()


def categorical(probs: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    return torch.multinomial(probs, 1, generator=g).squeeze(-1)


def simulate(p: torch.Tensor, q: torch.Tensor, sampler: Sampler, seed: int) -> torch.Tensor:
    """Counts of the first three emitted tokens over N runs of speculative decoding:
    each verify step drafts K tokens from q, verifies them against p with
    ``sampler``, and emits the accepted ones, then the replacement of the first
    rejected one, or (all accepted) a bonus token drawn from p."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((N, 3 + K + 1), -1, dtype=torch.int64)
    length = torch.zeros(N, dtype=torch.int64)
    while (length < 3).any():
        rows = (length < 3).nonzero().squeeze(1)
        n, at = len(rows), length[rows]
        prev = torch.where(at > 0, out[rows, (at - 1).clamp(min=0)], FIRST)
        drafts, ps, qs = [], [], []
        for j in range(K + 1):
            pos = (at + j).clamp(max=3)
            ps.append(p[pos, prev])
            if j < K:
                qs.append(q[pos, prev])
                drafts.append(categorical(qs[-1], g))
                prev = drafts[-1]
        d, pk, qk = torch.stack(drafts, 1), torch.stack(ps[:K], 1), torch.stack(qs, 1)
        uniform = torch.rand(n, K, generator=g)
        noise = torch.empty(n, K, V).exponential_(generator=g)
        accepted, recovered = sampler(pk, qk, d, torch.full((n,), K), uniform, noise)
        bonus = categorical(ps[K], g)
        for j in range(K + 1):  # emit token j of this step where it exists
            tok = bonus if j == K else torch.where(accepted > j, d[:, j], recovered[:, j])
            emit = accepted >= j
            out[rows[emit], (at + j)[emit]] = tok[emit]
        length[rows] += accepted + 1
    first3 = out[:, :3]
    return torch.bincount(first3[:, 0] * V * V + first3[:, 1] * V + first3[:, 2], minlength=V**3)


def accept_if_equal(p, q, drafts, num_drafts, uniform, noise):
    """Wrong: accept a draft when it equals a draw from p, and on a mismatch
    emit a fresh draw from p (the draw it was compared with is thrown away)."""
    draw = torch.searchsorted(p.cumsum(-1), uniform[..., None]).squeeze(-1)
    draw = draw.clamp(max=p.shape[-1] - 1)
    ok = (draw == drafts).long().cumprod(1).sum(1)
    return ok, p.div(noise).argmax(-1)


def residual_from_p(p, q, drafts, num_drafts, uniform, noise):
    """Wrong: accept with min(1, p/q), but replace a rejected draft from p, not max(0, p - q)."""
    accepted, _ = rejection_sample(p, q, drafts, num_drafts, uniform, noise)
    return accepted, p.div(noise).argmax(-1)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py


SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.7-topk5-topp0.9": SamplingParams(temperature=0.7, top_k=5, top_p=0.9),
    "t1.3-topp0.8-minp0.1": SamplingParams(temperature=1.3, top_p=0.8, min_p=0.1),
}


@pytest.mark.parametrize("name", SETTINGS)
def test_rejection_sampling_keeps_the_target_distribution(name: str) -> None:
    p, q = tables(SETTINGS[name], seed=len(name))
    exact = exact_joint(p)
    stat, critical = chi_square(simulate(p, q, rejection_sample, seed=1), exact)
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (alpha 1e-3)"
    for wrong in (accept_if_equal, residual_from_p):
        stat, critical = chi_square(simulate(p, q, wrong, seed=2), exact)
        assert stat > critical, f"{wrong.__name__} passed: chi-square {stat:.1f}"


def test_acceptance_is_min_one_p_over_q_and_stops_at_the_first_rejection() -> None:
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.8, 0.0], [1.0, 0.0, 0.0]]])
    q = torch.tensor([[[0.25, 0.75, 0.0], [0.1, 0.1, 0.8], [0.5, 0.5, 0.0]]])
    drafts = torch.tensor([[1, 2, 0]])  # p/q: 2/3, then 0 (rejected always), then 2
    noise = torch.ones(1, 3, 3)
    accepted, recovered = rejection_sample(
        p, q, drafts, torch.tensor([3]), torch.tensor([[0.6, 0.01, 0.01]]), noise
    )
    assert accepted.tolist() == [1]  # 0.6 * 0.75 < 0.5; then p(2) = 0
    assert recovered[0, 1].item() == 1  # max(0, p - q) at position 1 is [0.1, 0.7, 0]
    accepted, _ = rejection_sample(
        p, q, drafts, torch.tensor([3]), torch.tensor([[0.7, 0.01, 0.01]]), noise
    )
    assert accepted.tolist() == [0]  # 0.7 * 0.75 > 0.5
    assert recovered[0, 0].item() == 0  # max(0, p - q) at position 0 is [0.25, 0, 0]
    accepted, _ = rejection_sample(
        p, q, drafts, torch.tensor([0]), torch.tensor([[0.0, 0.0, 0.0]]), noise
    )
    assert accepted.tolist() == [0]  # no drafts: nothing to accept
