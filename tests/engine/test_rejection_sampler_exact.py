"""The rejection sampler's decisions pinned on constructed cases
(engine/sample/rejection_sampler.py). The distribution tests
(test_rejection_sampler.py) show that its output is distributed as p; these
show each step exactly: strict-match acceptance, p after the filters, acceptance
at min(1, p/q) at its boundary, the count of drafts, the residual and its empty
case, the random streams each position draws from, and which rows of the step's
tokens verification writes, keeps, and leaves to the bonus token.

Where the random draws would decide, the cases make p one-hot (a float32
softmax of logits 1000 apart is exactly one-hot): a draft p gives all its mass
is accepted whatever the uniform, one it gives none is rejected, and the
residual is then one-hot at p's token."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sample.rejection_sampler import (
    DraftCheck,
    SampledDrafts,
    draws,
    rejection_sample,
    target_probs,
    verify_sampled,
)
from engine.sample.sampler import RandomRows, SamplingRow, exponential_noise
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/engine/conftest.py

CPU = torch.device("cpu")
V = 6


def one_hot_logits(*tokens: int) -> torch.Tensor:
    """A logits row per token, whose softmax is exactly one-hot at it."""
    logits = torch.full((len(tokens), V), -1000.0)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 0.0
    return logits


def random_rows(n: int, params: SamplingParams, seed: int = 7, step: int = 0) -> RandomRows:
    return RandomRows.from_rows([SamplingRow(params, seed, step + i) for i in range(n)], V, CPU)


# ------------------------------------------------------------ strict match


def test_strict_match_counts_the_drafts_up_to_the_first_mismatch() -> None:
    sampled = torch.tensor([4, 4, 4, 2, 3, 3])
    check = DraftCheck(
        torch.tensor([[4, 4, 4], [3, -1, -1], [2, 3, -1]]),
        torch.tensor([[0, 1, 2], [3, 3, 3], [2, 3, 4]]),
    )
    # 4 4 4 all match; 3 against 2 fails at once; 2 against 4 fails at once.
    assert check.num_accepted(sampled).tolist() == [3, 0, 0]
    check.drafts[2] = torch.tensor([4, 2, -1])
    assert check.num_accepted(sampled).tolist() == [3, 0, 2]  # and -1 never matches
    assert check.sampled is None


# ------------------------------------------------------------ p


def test_p_is_the_filtered_softmax_over_the_whole_vocabulary() -> None:
    logits = torch.log(torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 1.0]]))
    total = 32.0
    plain = target_probs(logits, random_rows(1, SamplingParams(temperature=1.0)))
    expected = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0, 1.0]]) / total
    assert torch.allclose(plain, expected, rtol=0, atol=1e-7)
    # Top-k 2 keeps 16 and 8, renormalised, at their own ids; the rest 0 exactly.
    top2 = target_probs(logits, random_rows(1, SamplingParams(temperature=1.0, top_k=2)))
    assert torch.allclose(top2, torch.tensor([[0, 0, 0, 1 / 3, 2 / 3, 0]]), rtol=0, atol=1e-7)
    assert (top2[0, :3] == 0).all() and top2[0, 5] == 0
    # Temperature 2 halves the log-odds: sqrt of each weight.
    warm = target_probs(logits, random_rows(1, SamplingParams(temperature=2.0)))
    roots = torch.tensor([1.0, 2.0, 4.0, 8.0, 16.0, 1.0]).sqrt()
    assert torch.allclose(warm, (roots / roots.sum())[None], rtol=0, atol=1e-7)


# ------------------------------------------------------------ rejection_sample


def test_a_draft_is_accepted_exactly_when_uniform_times_q_is_below_p() -> None:
    # One request, one draft (token 1): p(1) = 0.25, q(1) = 0.5, so the draft is
    # accepted with probability 1/2: for a uniform below 0.5, and not at 0.5.
    p = torch.tensor([[[0.75, 0.25, 0.0]]])
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    drafts, one, noise = torch.tensor([[1]]), torch.tensor([1]), torch.ones(1, 1, 3)
    for u, expected in ((0.25, 1), (0.4999, 1), (0.5, 0), (0.75, 0)):
        accepted, recovered = rejection_sample(p, q, drafts, one, torch.tensor([[u]]), noise)
        assert accepted.tolist() == [expected], u
        assert recovered.tolist() == [[0]]  # max(0, p - q) = [0.25, 0, 0]


def test_only_a_request_s_own_drafts_count_and_acceptance_stops_at_a_rejection() -> None:
    # Three positions, p = q everywhere: every real draft is accepted (u * q < q).
    p = torch.tensor([[0.1, 0.2, 0.7]]).expand(4, 3, 3).contiguous()
    drafts = torch.tensor([[2, 2, 2], [1, 0, 2], [2, 2, 2], [0, 0, 0]])
    num = torch.tensor([3, 2, 1, 0])
    uniform = torch.full((4, 3), 0.9)
    accepted, _ = rejection_sample(p, p.clone(), drafts, num, uniform, torch.ones(4, 3, 3))
    assert accepted.tolist() == [3, 2, 1, 0]
    # p(2) = 0 at the second position of the first request: it and all after it fail.
    p2 = p.clone()
    p2[0, 1] = torch.tensor([0.5, 0.5, 0.0])
    accepted, recovered = rejection_sample(p2, p, drafts, num, uniform, torch.ones(4, 3, 3))
    assert accepted.tolist() == [1, 2, 1, 0]
    # The residual there, max(0, [0.5, 0.5, 0] - [0.1, 0.2, 0.7]) = [0.4, 0.3, 0]: token 0.
    assert recovered[0, 1].item() == 0


def test_the_replacement_comes_from_the_residual_and_from_p_where_p_equals_q() -> None:
    # p = [0.6, 0.4, 0], q = [0.9, 0.1, 0]: residual [0, 0.3, 0], token 1, where
    # p's own mode is token 0.
    p = torch.tensor([[[0.6, 0.4, 0.0], [0.1, 0.2, 0.7]]])
    q = torch.tensor([[[0.9, 0.1, 0.0], [0.1, 0.2, 0.7]]])  # position 1: q = p
    drafts, num = torch.tensor([[0, 2]]), torch.tensor([2])
    uniform = torch.tensor([[0.99, 0.5]])  # 0.99 * 0.9 >= 0.6: rejected
    noise = torch.ones(1, 2, 3)
    accepted, recovered = rejection_sample(p, q, drafts, num, uniform, noise)
    assert accepted.tolist() == [0]
    # Position 1: p - q is 0 everywhere, so the replacement is drawn from p: its
    # mode with unit noise, token 2 (not the 0 an all-zero residual would give).
    assert recovered.tolist() == [[1, 2]]
    # The race at position 1: noise 8 on token 2 makes it 0.2 / 1 > 0.7 / 8.
    noise = torch.tensor([[[1.0, 1.0, 1.0], [1.0, 1.0, 8.0]]])
    assert rejection_sample(p, q, drafts, num, uniform, noise)[1].tolist() == [[1, 1]]
    # p is left as it was.
    p_before = p.clone()
    rejection_sample(p, q, drafts, num, uniform, noise)
    assert torch.equal(p, p_before)


# ------------------------------------------------------------ the random streams


def test_each_position_draws_its_uniform_and_race_from_ids_past_the_vocabulary() -> None:
    r = random_rows(3, SamplingParams(temperature=1.0), seed=11, step=4)
    uniform, noise = draws(r, V)
    assert uniform.shape == (3,) and noise.shape == (3, V)
    # The uniform: the Exp(1) draw at id 2V, as exp(-E), so in (0, 1).
    at_2v = exponential_noise(r.seeds, r.steps, torch.full((3, 1), 2 * V), V)
    assert torch.equal(uniform, at_2v.squeeze(1).neg().exp())
    assert ((uniform > 0) & (uniform < 1)).all()
    # The race's noise: ids V..2V-1, not the ordinary draw's 0..V-1.
    ids = torch.arange(V, 2 * V).expand(3, -1)
    assert torch.equal(noise, exponential_noise(r.seeds, r.steps, ids, V))
    ordinary = exponential_noise(r.seeds, r.steps, None, V)
    assert not torch.isclose(noise, ordinary).any()
    assert not torch.isclose(uniform[:, None], noise).any()
    # Each position's own step: the three rows differ.
    assert len(set(uniform.tolist())) == 3


# ------------------------------------------------------------ verify_sampled


def sampled(rows, drafts, num, probs, params, seed: int = 3) -> SampledDrafts:
    """SampledDrafts for one or more requests, their positions' filters from params."""
    flat = [SamplingRow(params, seed, j) for r in rows for j, _ in enumerate(r)]
    return SampledDrafts(
        index=torch.tensor([i for i, _ in enumerate(rows)]),
        rows=torch.tensor(rows),
        drafts=torch.tensor(drafts),
        num_drafts=torch.tensor(num),
        probs=probs,
        filters=RandomRows.from_rows(flat, V, CPU),
    )


def test_verification_writes_accepted_drafts_and_the_replacement_and_keeps_the_rest() -> None:
    """Two drafting requests; only the second (index 1) is sampled. Its drafts
    are checked at rows 3, 4, 5, and row 6 holds its bonus token. p accepts
    draft 0 (p one-hot at it) and rejects draft 1 (p one-hot at token 5)."""
    logits = torch.cat([one_hot_logits(0, 0, 0), one_hot_logits(2, 5, 1, 3)])
    tokens = torch.tensor([10, 11, 12, 13, 14, 15, 16])  # the step's ordinary draws
    accepted = torch.tensor([2, 0])  # by strict match
    q = torch.full((1, 3, V), 1.0 / V)
    sd = sampled([[3, 4, 5]], [[2, 4, 1]], [3], q, SamplingParams(temperature=1.0))
    sd.index = torch.tensor([1])
    out, acc = verify_sampled(logits, tokens, accepted, sd)
    assert acc.tolist() == [2, 1]
    assert out.tolist() == [10, 11, 12, 2, 5, 15, 16]
    # The inputs are left as they were.
    assert tokens.tolist() == [10, 11, 12, 13, 14, 15, 16] and accepted.tolist() == [2, 0]


def test_all_drafts_accepted_leave_the_bonus_row_its_ordinary_draw() -> None:
    """Two sampled requests of one and two drafts, padded to width 2: the first's
    padding column repeats its bonus row (2), as draft_check builds it. All drafts
    accepted: the drafts are written, and both bonus rows keep their own draws."""
    logits = torch.cat([one_hot_logits(4, 1), one_hot_logits(3, 2, 0)])
    tokens = torch.tensor([20, 21, 22, 23, 24])
    q = torch.zeros(2, 2, V)
    q[0, 0, 4] = q[1, 0, 3] = q[1, 1, 2] = 1.0
    rows, drafts = [[0, 1], [2, 3]], [[4, 0], [3, 2]]
    sd = sampled(rows, drafts, [1, 2], q, SamplingParams(temperature=0.8))
    out, acc = verify_sampled(logits, tokens, torch.tensor([0, 0]), sd)
    assert acc.tolist() == [1, 2]
    assert out.tolist() == [4, 21, 3, 2, 24]


def test_a_draft_p_never_gives_is_rejected_and_replaced_from_p() -> None:
    logits = one_hot_logits(3, 1)
    q = torch.zeros(1, 1, V)
    q[0, 0, 5] = 1.0
    sd = sampled([[0]], [[5]], [1], q, SamplingParams(temperature=1.0, top_k=3))
    out, acc = verify_sampled(logits, torch.tensor([30, 31]), torch.tensor([1]), sd)
    assert acc.tolist() == [0]
    assert out.tolist() == [3, 31]  # the replacement at row 0; row 1 untouched


def test_the_uniform_decides_at_p_over_q_with_the_request_s_own_stream() -> None:
    """p(x) = q(x) / 2 for a draft x: accepted exactly when the position's uniform
    (draws, at id 2V) is below 1/2. Over many seeds, both happen, each as that
    uniform says."""
    logits = torch.log(torch.tensor([[1.0, 1.0, 2.0, 4.0, 0.5, 0.5]]))  # p(3) = 4/9
    q = torch.zeros(1, 1, V)
    q[0, 0, 3], q[0, 0, 0] = 8 / 9, 1 / 9
    params = SamplingParams(temperature=1.0)
    seen = set()
    for seed in range(16):
        sd = sampled([[0]], [[3]], [1], q, params, seed=seed)
        uniform, _ = draws(sd.filters, V)
        px = target_probs(logits, sd.filters)[0, 3]
        assert math.isclose(px.item(), 4 / 9, rel_tol=1e-6)
        out, acc = verify_sampled(logits, torch.tensor([40, 41]), torch.tensor([0]), sd)
        expected = int((uniform[0] * q[0, 0, 3] < px).item())
        assert acc.tolist() == [expected], seed
        # Row 0 is written either way: the draft, or a replacement from the residual,
        # which gives token 3 nothing (p(3) < q(3)). Row 1 keeps its bonus draw.
        assert out[0].item() != 40 and out[1].item() == 41
        assert (out[0].item() == 3) == bool(expected)
        seen.add(expected)
    assert seen == {0, 1}


# ------------------------------------------------------------ the device


def test_every_tensor_the_sampler_makes_is_on_its_inputs_device() -> None:
    """On a GPU, a tensor made without naming a device lands on the CPU, and the
    first operation that mixes it with the logits fails. Here the inputs are on
    the CPU and torch's default device is "meta" (no data, no kernels): a tensor
    made anywhere without the inputs' device is a meta tensor, and mixing it with
    them raises. The results are the CPU ones, exactly."""
    logits = torch.cat([one_hot_logits(4, 1), one_hot_logits(3, 2, 0)])
    tokens, accepted = torch.tensor([20, 21, 22, 23, 24]), torch.tensor([0, 0])
    q = torch.zeros(2, 2, V)
    q[0, 0, 4] = q[1, 0, 3] = q[1, 1, 2] = 1.0
    params = SamplingParams(temperature=0.8, top_k=4, top_p=0.9, min_p=0.01)
    sd = sampled([[0, 1], [2, 3]], [[4, 0], [3, 2]], [1, 2], q, params)
    five = random_rows(5, params)
    with torch.device("meta"):
        uniform, noise = draws(sd.filters, V)
        p = target_probs(logits, five)
        out, acc = verify_sampled(logits, tokens, accepted, sd)
    assert {t.device for t in (uniform, noise, p, out, acc)} == {CPU}
    assert acc.tolist() == [1, 2] and out.tolist() == [4, 21, 3, 2, 24]
