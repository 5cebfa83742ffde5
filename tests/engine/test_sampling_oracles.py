"""Sampling and structured output, where the existing checks would pass a broken engine.

* A seeded request's tokens must come from fresh noise at every position: the
  model runner advances each request's sample counter, and token ``step`` draws
  the sampler's documented noise for (seed, step). Reproducibility, which the
  other tests check, survives a counter that never moves; these tests do not.
* Logprobs are the model's own, from the logits before any grammar mask
  (engine/sample/sampler.py, ``Sampler.__call__`` and ``compute_logprobs``),
  also for a request under structured output.
* Under chunked prefill, a prompt chunk that does not reach the prompt's end
  samples nothing: it gets no grammar mask row, and the request's output still
  follows its grammar.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sample.sampler import exponential_noise
from tests.engine.conftest import VOCAB, random_prompts

REGEX = r"(prefill|decode) [0-9]{1,3} tokens"


@pytest.fixture(scope="module")
def llm(qwen3: tuple[Path, torch.nn.Module]) -> LLM:
    return LLM(qwen3[0], dtype="float32")


def hf_logits(model: torch.nn.Module, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits, in float64, at the position that chose each token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return logits.double()


# --- Every position draws its own noise ------------------------------------


def test_a_seeded_request_draws_fresh_noise_at_every_position(llm: LLM) -> None:
    """At a temperature so high that the distribution is all but uniform over the
    320 tokens, the tokens of a seeded request look like independent uniform draws.
    Guards the runner's sample counter: if every step reused step 0's noise, the
    race argmax(p / E) with p flat and E fixed would pick the same token each time.

    Under independence a position repeats the token before it with probability
    about 1/320: over 4 x 23 pairs, 0.3 repeats are expected and 5 or more have
    probability ~2e-5. 24 uniform draws of 320 give ~23.2 distinct tokens."""
    prompts = random_prompts(4, seed=3)
    params = [
        SamplingParams(temperature=1000.0, seed=s, max_tokens=24, ignore_eos=True)
        for s in (11, 12, 13, 14)
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    repeats = 0
    for out in outs:
        tokens = out.token_ids
        assert len(tokens) == 24
        repeats += sum(a == b for a, b in zip(tokens, tokens[1:]))
        assert len(set(tokens)) >= 18, tokens  # far below the ~23.2 expected
    assert repeats <= 4, [o.token_ids for o in outs]


def test_each_position_follows_the_sampler_noise_for_its_step(
    llm: LLM, qwen3: tuple[Path, torch.nn.Module]
) -> None:
    """Token t of a seeded request is argmax(softmax(logits_t) / E(seed, t)), the
    exponential race with the noise the sampler documents for (seed, step t),
    logits_t from transformers on the prompt and the tokens before t. Guards the
    step the runner passes: a counter stuck at 0 draws E(seed, 0) at every t.
    Positions whose race is within 1e-3 of a tie are not judged (float32 logits
    may differ from transformers' by ~1e-5)."""
    prompt, seed, n = random_prompts(1, seed=8)[0], 4321, 10
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
    probs = hf_logits(qwen3[1], prompt, tokens).softmax(-1)
    steps = torch.arange(n, dtype=torch.int64)
    noise = exponential_noise(torch.full((n,), seed, dtype=torch.int64), steps, None, VOCAB)
    race = probs / noise.double()
    top2 = race.topk(2, dim=-1)
    clear = top2.values[:, 0] > top2.values[:, 1] * (1 + 1e-3)
    assert clear.sum() >= n - 2  # nearly every position can be judged
    expected = top2.indices[:, 0]
    judged = [(t, tokens[t], expected[t].item()) for t in range(n) if clear[t]]
    assert all(got == want for _, got, want in judged), judged
    # The check can tell the steps apart: step 0's noise alone gives other tokens.
    stale = (probs / noise[:1].double()).argmax(-1)
    assert (stale != expected).any()


# --- Logprobs under a grammar are the model's own ---------------------------


def test_logprobs_under_a_grammar_are_the_models_own(
    llm: LLM, qwen3: tuple[Path, torch.nn.Module]
) -> None:
    """With structured output on, each returned logprob (the chosen token's and
    the top 3) is the model's unmasked log-softmax, from transformers: the
    convention documented in Sampler.__call__. Guards against computing them
    from the grammar-masked logits, which puts every forbidden token at -inf
    and gives the allowed ones the whole mass."""
    spec = StructuredOutputsParams(regex=REGEX)
    prompts = random_prompts(2, seed=5)
    params = [
        SamplingParams(temperature=0, max_tokens=24, logprobs=3, structured_outputs=spec),
        SamplingParams(temperature=1.0, seed=9, max_tokens=24, logprobs=3, structured_outputs=spec),
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    constrained = 0  # positions where the grammar overruled the model's own choice
    for prompt, out in zip(prompts, outs):
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
        ref = torch.log_softmax(hf_logits(qwen3[1], prompt, out.token_ids), dim=-1)
        assert len(out.logprobs) == len(out.token_ids)
        for token, entry, row in zip(out.token_ids, out.logprobs, ref):
            top = row.topk(3).indices.tolist()
            constrained += token not in top
            assert set(entry) == set(top) | {token}, (entry, top, token)
            for t, value in entry.items():
                assert abs(value - row[t].item()) < 1e-4, (t, value, row[t].item())
    assert constrained > 0  # the premise: masked and unmasked logprobs differ here


# --- Chunked prefill under a grammar ----------------------------------------


def test_partial_prompt_chunks_get_no_grammar_mask(qwen3: tuple[Path, torch.nn.Module]) -> None:
    """Prompts longer than the step's token budget are prefilled in chunks, while
    another constrained request decodes beside them. Every request's output
    follows its grammar, and each step's mask rows are exactly the constrained
    requests that sample in it. Guards against asking for a mask row for a
    chunk that samples nothing: the runner has no logits row for it, and the
    step fails."""
    llm = LLM(qwen3[0], dtype="float32", max_num_batched_tokens=16)
    engine = llm.llm_engine
    manager = engine.structured_output
    fill = manager.fill_bitmask
    seen: list[tuple[list[str], list[str]]] = []  # per step: (rows sampling, mask rows)

    def recording_fill(scheduler_output, requests) -> None:
        fill(scheduler_output, requests)
        sampling = [
            item.req_id
            for item in scheduler_output.scheduled
            if item.samples and requests[item.req_id].structured_output is not None
        ]
        grammar = scheduler_output.grammar
        rows = [] if grammar is None else list(grammar.req_ids)
        if grammar is not None:
            assert grammar.bitmask.shape[0] == len(rows)
        seen.append((sampling, rows))

    manager.fill_bitmask = recording_fill
    spec = StructuredOutputsParams(regex=REGEX)
    short, long_a, long_b = random_prompts(3, seed=17, low=40, high=60)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured_outputs=spec)
    partial_before = engine.stats.partial_prefills
    outs = llm.generate([short[:5], long_a, long_b], [params] * 3, use_tqdm=False)
    assert engine.stats.partial_prefills - partial_before >= 4  # the premise: chunks ran
    for out in outs:
        assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text), out.text
    assert any(sampling for sampling, _ in seen)
    for sampling, rows in seen:
        assert rows == sampling, (rows, sampling)
