"""Sampling: seeded requests are reproducible whatever shares their batch, the
filters apply in their documented order, seeded draws follow the filtered
distribution, and logprobs are those of the model, row by row."""

from __future__ import annotations

import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sample.sampler import Sampler, SamplingMetadata, SamplingRow, apply_filters
from tests.engine.conftest import random_prompts

PROMPTS = random_prompts(8, seed=21)


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(qwen3[0], dtype="float32")


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True, **kw)


def test_same_seed_same_tokens_whatever_the_batch(llm, qwen3) -> None:
    target = PROMPTS[0]
    alone = llm.generate([target], seeded(1234), use_tqdm=False)[0].token_ids
    # In a batch, at a different position, with other seeded and unseeded requests.
    others = [seeded(i) for i in range(1, 7)] + [SamplingParams(temperature=0.8, max_tokens=12)]
    batch = PROMPTS[1:] + [target]
    mixed = llm.generate(batch, others + [seeded(1234)], use_tqdm=False)[-1].token_ids
    assert mixed == alone
    # Under memory pressure, with preemption and recompute.
    tight = LLM(qwen3[0], dtype="float32", num_kv_blocks=8)
    squeezed = tight.generate(batch, others + [seeded(1234)], use_tqdm=False)[-1].token_ids
    assert tight.stats.preemptions > 0
    assert squeezed == alone


def test_different_seeds_differ_and_sampling_is_not_greedy(llm) -> None:
    outs = llm.generate([PROMPTS[0]] * 6, [seeded(s) for s in range(6)], use_tqdm=False)
    assert len({tuple(o.token_ids) for o in outs}) > 1


def test_unseeded_requests_are_reproducible_from_the_engine_seed(qwen3) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    a = LLM(qwen3[0], dtype="float32", seed=5).generate(PROMPTS[:4], params, use_tqdm=False)
    b = LLM(qwen3[0], dtype="float32", seed=5).generate(PROMPTS[:4], params, use_tqdm=False)
    c = LLM(qwen3[0], dtype="float32", seed=6).generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_top_k_1_and_tiny_top_p_are_greedy(llm) -> None:
    greedy = llm.generate(
        PROMPTS[:3], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False
    )
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        hot = SamplingParams(temperature=1.5, max_tokens=10, seed=99, ignore_eos=True, **kw)
        outs = llm.generate(PROMPTS[:3], hot, use_tqdm=False)
        assert [o.token_ids for o in outs] == [o.token_ids for o in greedy], kw


# --- The filters, against a plain statement of their order -------------------


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """The documented order, written out with Python floats: divide by the
    temperature, keep the top k, keep the smallest head of the sorted
    distribution whose mass reaches top_p, keep tokens whose probability is at
    least min_p times the largest; then renormalise what is kept."""
    z = [x / p.temperature for x in logits]
    keep = [True] * len(z)
    if p.top_k > 0:
        kth = sorted(z, reverse=True)[min(p.top_k, len(z)) - 1]
        keep = [k and x >= kth for k, x in zip(keep, z)]

    def probs() -> list[float]:
        top = max(x for x, k in zip(z, keep) if k)
        e = [math.exp(x - top) if k else 0.0 for x, k in zip(z, keep)]
        return [v / sum(e) for v in e]

    if p.top_p < 1:
        q = probs()
        mass = 0.0
        for i in sorted(range(len(z)), key=lambda i: -q[i]):
            if mass >= p.top_p:  # the token that crosses top_p is kept
                keep[i] = False
            mass += q[i]
    if p.min_p > 0:
        q = probs()
        keep = [k and v >= p.min_p * max(q) for k, v in zip(keep, q)]
    return probs()


def metadata(params: list[SamplingParams], vocab: int, seeds=None, steps=None) -> SamplingMetadata:
    seeds = seeds or [0] * len(params)
    steps = steps or [0] * len(params)
    rows = [SamplingRow(p, seed, step) for p, seed, step in zip(params, seeds, steps)]
    return SamplingMetadata.from_rows(rows, vocab_size=vocab, device=torch.device("cpu"))


def engine_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution the engine's sampler draws each row from."""
    filtered, ids = apply_filters(logits, metadata(params, logits.shape[-1]).random)
    probs = filtered.softmax(-1)
    return probs if ids is None else torch.zeros_like(logits).scatter_(1, ids, probs)


FILTERS = [
    SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
    for t in (0.5, 2.0)
    for k in (0, 12)
    for p in (0.5, 0.8, 1.0)
    for m in (0.0, 0.05, 0.2)
]


def test_filters_apply_temperature_then_top_k_top_p_min_p() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 40, generator=g, dtype=torch.float64) * 2
    for p in FILTERS:
        got = engine_probs(logits.float(), [p] * len(logits)).double()
        for row, probs in zip(logits.tolist(), got):
            want = torch.tensor(reference_probs(row, p), dtype=torch.float64)
            assert torch.equal(probs > 0, want > 0), p  # the same tokens survive
            assert torch.allclose(probs, want, atol=1e-6), p


def test_each_row_of_a_mixed_batch_keeps_its_own_filters() -> None:
    """Rows with different settings share one set of tensor operations: top-k
    takes the batch's largest k, then cuts each row at its own, and top-p runs
    for the batch when any row asks. Each row must still get exactly its own
    filtered distribution: a row with a smaller k keeps k tokens, not k + 1, and
    a row with top_p 1 keeps its whole tail, even where float32's running mass
    reaches 1 before the last token (the last row: one token holds almost all)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(len(FILTERS) + 1, 40, generator=g, dtype=torch.float64) * 2
    logits[-1, 0] = 30.0  # the others' mass, about 40 * e**-30, vanishes in a float32 sum
    params = [*FILTERS, SamplingParams(temperature=1.0, top_k=20)]
    got = engine_probs(logits.float(), params).double()
    for row, p, probs in zip(logits.tolist(), params, got):
        want = torch.tensor(reference_probs(row, p), dtype=torch.float64)
        assert torch.equal(probs > 0, want > 0), p
        assert torch.allclose(probs, want, atol=1e-6), p


def chi_square_critical(df: int, z: float = 3.72) -> float:
    """The chi-square quantile at z standard deviations (3.72: one in 10,000),
    by the Wilson-Hilferty approximation."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.02),
    ],
    ids=["temperature", "every-filter"],
)
def test_seeded_draws_follow_the_filtered_distribution(params) -> None:
    """Many seeded draws from one row of logits, counted against the exact
    filtered softmax: a chi-square test over the tokens that can be drawn."""
    g = torch.Generator().manual_seed(5)
    row = torch.randn(48, generator=g) * 1.5
    want = reference_probs(row.double().tolist(), params)
    draws = 6000
    counts = [0] * len(want)
    for token in sample_many(row, params, draws):
        counts[token] += 1
    assert all(c == 0 for c, w in zip(counts, want) if w == 0)  # filtered tokens never drawn
    # Pool the rare tokens so every cell expects at least 5 draws.
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for c, w in sorted(zip(counts, want), key=lambda cw: -cw[1]):
        if w == 0:
            continue
        if w * draws >= 5:
            cells.append((c, w * draws))
        else:
            pooled_obs, pooled_exp = pooled_obs + c, pooled_exp + w * draws
    if pooled_exp:
        cells.append((pooled_obs, pooled_exp))
    chi2 = sum((o - e) ** 2 / e for o, e in cells)
    assert chi2 < chi_square_critical(len(cells) - 1), (chi2, len(cells))


def sample_many(row: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    """n draws from one row of logits: n seeded requests, at assorted steps."""
    steps = [seed % 5 for seed in range(n)]
    md = metadata([params] * n, len(row), seeds=list(range(n)), steps=steps)
    return Sampler()(row.expand(n, -1).contiguous(), md).sampled_token_ids.tolist()


# --- Logprobs, against transformers -----------------------------------------


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' log-softmax at the position that chose each generated token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.double(), dim=-1)


def assert_logprobs_match(out, n: int, reference: torch.Tensor) -> None:
    """Each entry holds the chosen token and the top n, with transformers' values."""
    assert len(out.logprobs) == len(out.token_ids)
    for token, entry, ref in zip(out.token_ids, out.logprobs, reference):
        top = ref.topk(n).indices.tolist() if n else []
        assert set(entry) == set(top) | {token}
        for t, value in entry.items():
            assert abs(value - ref[t].item()) < 1e-4, (t, value, ref[t].item())


def test_logprobs_are_the_models(llm, qwen3) -> None:
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3, ignore_eos=True)
    for prompt, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], params, use_tqdm=False)):
        assert len(out.token_ids) == 5
        assert_logprobs_match(out, 3, hf_logprobs(qwen3[1], prompt, out.token_ids))
        for token, entry in zip(out.token_ids, out.logprobs):
            assert entry[token] == max(entry.values())  # greedy takes the most likely


def test_logprobs_read_their_own_rows_in_a_mixed_batch(llm, qwen3) -> None:
    """Only some requests ask, for different counts, among greedy and sampled
    ones: each gets the logprobs of its own row, from its first token on."""
    asks = [None, 2, None, 0, 4, None, 1, 3]
    params = [
        SamplingParams(
            temperature=0 if i % 2 else 0.9, seed=i, max_tokens=4, logprobs=n, ignore_eos=True
        )
        for i, n in enumerate(asks)
    ]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, n, out in zip(PROMPTS, asks, outs):
        if n is None:
            assert out.logprobs is None
        else:
            assert_logprobs_match(out, n, hf_logprobs(qwen3[1], prompt, out.token_ids))


# --- The batched sampler itself ---------------------------------------------


def test_a_seeded_row_draws_the_same_alone_or_in_any_batch() -> None:
    """The noise, and so the token, of a (seed, step) row does not depend on the
    rows beside it, on its position, or on whether the others are greedy."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(7, 300, generator=g)
    hot = SamplingParams(temperature=1.0, top_p=0.95)
    params = [hot, SamplingParams(temperature=0), hot, hot, SamplingParams(temperature=0.5)] + [
        hot
    ] * 2
    seeds, steps = [11, 0, 12, 13, 14, 15, 16], [3, 0, 1, 4, 1, 5, 9]
    batch = Sampler()(logits, metadata(params, 300, seeds, steps)).sampled_token_ids
    for i in range(7):
        alone = Sampler()(
            logits[i : i + 1], metadata(params[i : i + 1], 300, seeds[i : i + 1], steps[i : i + 1])
        )
        if params[i].greedy:
            assert alone.sampled_token_ids.item() == logits[i].argmax().item() == batch[i]
        assert alone.sampled_token_ids.item() == batch[i]
    shuffled = [6, 4, 2, 0, 1, 3, 5]
    again = Sampler()(
        logits[shuffled],
        metadata(
            [params[i] for i in shuffled],
            300,
            [seeds[i] for i in shuffled],
            [steps[i] for i in shuffled],
        ),
    ).sampled_token_ids
    assert again.tolist() == batch[shuffled].tolist()


def test_the_sampler_runs_the_same_operations_for_any_batch_size() -> None:
    """No per-row Python loop: the tensor operations the sampler dispatches are
    the same in number and kind for 4 rows as for 64."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    def ops(rows: int) -> list[str]:
        params = [
            SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, logprobs=2),
            SamplingParams(temperature=0, logprobs=1),
        ] * (rows // 2)
        md = metadata(params, 100, seeds=list(range(rows)), steps=list(range(rows)))
        logits = torch.randn(rows, 100)
        with Recorder() as recorder:
            Sampler()(logits, md)
        return recorder.ops

    ops(4)  # fill the sampler's per-vocabulary cache of token hashes first
    assert ops(4) == ops(64)


def test_a_temperature_near_zero_is_greedy_not_an_overflow() -> None:
    """Logits over a subnormal temperature are infinities, whose softmax is NaN;
    the fuzzer's 2.2e-309 made a grammar request sample a token its mask forbade."""
    from engine.sampling_params import SAMPLING_EPS, SamplingParams

    assert SamplingParams(temperature=2.2e-309).greedy
    assert SamplingParams(temperature=SAMPLING_EPS / 2).greedy
    assert not SamplingParams(temperature=SAMPLING_EPS).greedy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 151_936), (64, 4096), (3, 7), (5, 1)])
def test_argmax_picks_torch_argmaxs_index_ties_infinities_and_nans_too(dtype, shape) -> None:
    """sampler.argmax (torch.max's index) against torch.argmax, on fresh inputs each
    run: small integers, so that most rows tie, with some infinities and NaNs."""
    from engine.sample.sampler import argmax

    gen = torch.Generator().manual_seed(torch.seed())
    for _ in range(5):
        x = torch.randint(-3, 4, shape, generator=gen).to(dtype)
        odd = torch.rand(shape, generator=gen)
        x[odd < 0.01] = float("inf")
        x[(odd > 0.5) & (odd < 0.501)] = float("-inf")
        x[odd > 0.999] = float("nan")
        assert torch.equal(argmax(x), x.argmax(dim=-1))
    everywhere = torch.full(shape, float("-inf"), dtype=dtype)
    assert torch.equal(argmax(everywhere), everywhere.argmax(dim=-1))
