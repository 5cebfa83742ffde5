"""SamplingParams.prompt_logprobs, as vLLM defines it: per prompt token after the
first, {token id: logprob} for the prompt's own token and the top k, from the
model's log-softmax given the prompt before it; None for the first token.

The oracle is transformers' log_softmax over the whole prompt, in float32, on
tiny random Llama, Qwen3 and DeepSeek-V3 checkpoints: equal within 1e-5 whether
the prompt runs whole, in chunks, preempted in the middle of its prompt and
recomputed, or under async scheduling; and each entry is computed exactly once,
at its position. A request that asks takes no prefix-cache hit; a step where no
request asks computes logits for its sampled rows alone; and /v1/completions
takes vLLM's prompt_logprobs extra and returns vLLM's shape.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import httpx
import pytest
import torch

import engine.runner.model_runner as model_runner
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from tests.engine.conftest import VOCAB, build_checkpoint, hf_greedy, random_prompts
from tests.server.conftest import in_thread

K = 3
MAX_TOKENS = 6
ATOL = 1e-5
PROMPTS = random_prompts(3, seed=71, low=30, high=44)  # 30 to 43 tokens each

REGIMES = {
    "whole": {"block_size": 8},
    "chunked": {"block_size": 4, "max_num_batched_tokens": 8},
    # 14 blocks of 4 hold 56 tokens: while the first request decodes, the second
    # cannot add its second 16-token chunk and gives way, mid-prompt.
    "preempted": {"block_size": 4, "num_kv_blocks": 14, "max_num_batched_tokens": 16},
    "async-chunked": {"block_size": 4, "max_num_batched_tokens": 8, "async_scheduling": True},
}


@pytest.fixture(scope="module", params=["llama", "qwen3", "deepseek"])
def model(request, tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(f"plp-{request.param}")
    return path, build_checkpoint(request.param, path)


def hf_logprobs(model: torch.nn.Module, prompt: list[int]) -> torch.Tensor:
    """Row j: transformers' log_softmax after prompt[: j + 1], in float32."""
    with torch.no_grad():
        return model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)


def assert_matches(entries: list[dict[int, float] | None], prompt: list[int], ref, k: int) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for j in range(1, len(prompt)):
        row = ref[j - 1]
        want = set(row.topk(k).indices.tolist()) | {prompt[j]}
        assert set(entries[j]) == want, j
        for token, value in entries[j].items():
            assert abs(value - row[token].item()) <= ATOL, (j, token, value, row[token].item())


class Spy:
    """Every prompt-logprob row each step fills, and every preemption, as they happen."""

    def __init__(self, llm: LLM, monkeypatch) -> None:
        self.filled: Counter[tuple[int, int]] = Counter()  # (buffer, row) -> times
        self.mid_prompt_preemptions = 0
        fill = model_runner.fill_prompt_logprobs

        def counting_fill(prompt, logits):
            for buf, first, n in prompt.spans:
                self.filled.update((id(buf), j) for j in range(first, first + n))
            return fill(prompt, logits)

        monkeypatch.setattr(model_runner, "fill_prompt_logprobs", counting_fill)
        scheduler = llm.llm_engine.scheduler
        preempt = scheduler._preempt

        def noting_preempt(seq):
            self.mid_prompt_preemptions += seq.num_computed_tokens < seq.num_prompt_tokens
            preempt(seq)

        scheduler._preempt = noting_preempt


@pytest.mark.parametrize("regime", REGIMES, ids=list(REGIMES))
def test_prompt_logprobs_match_transformers(model, regime, monkeypatch) -> None:
    path, hf = model
    llm = LLM(path, dtype="float32", **REGIMES[regime])
    spy = Spy(llm, monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    asked = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=K)
    # The middle request asks, and under preemption the last (which gives way) too;
    # the others, in the same batches, do not.
    last = asked if regime == "preempted" else params
    outs = llm.generate(PROMPTS, [params, asked, last], use_tqdm=False)
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS)
        if out.prompt_logprobs is None:
            assert i == 0 or (i == 2 and regime != "preempted")
            continue
        assert_matches(out.prompt_logprobs, prompt, hf_logprobs(hf, prompt), K)
    rows = sum(len(p) - 1 for p, o in zip(PROMPTS, outs) if o.prompt_logprobs is not None)
    assert len(spy.filled) == rows and set(spy.filled.values()) == {1}  # each row once
    if regime == "preempted":
        assert spy.mid_prompt_preemptions >= 1
    assert not llm.llm_engine.executor.model_runner.input_batch.pending_prompt_logprobs


def test_a_request_that_asks_takes_no_prefix_hit(tmp_path) -> None:
    hf = build_checkpoint("qwen3", tmp_path)
    llm = LLM(tmp_path, dtype="float32", block_size=4)
    prompt, greedy = PROMPTS[0], SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate(prompt, greedy, use_tqdm=False)[0]
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0)
    again = llm.generate(prompt, asked, use_tqdm=False)[0]
    third = llm.generate(prompt, greedy, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and third.num_cached_tokens > 0
    assert again.num_cached_tokens == 0
    assert [len(e) for e in again.prompt_logprobs[1:]] == [1] * (len(prompt) - 1)
    assert_matches(again.prompt_logprobs, prompt, hf_logprobs(hf, prompt), 0)
    assert first.prompt_logprobs is None and third.prompt_logprobs is None


def test_steps_without_a_request_that_asks_compute_only_sampled_rows(tmp_path) -> None:
    build_checkpoint("llama", tmp_path)
    llm = LLM(tmp_path, dtype="float32", block_size=4, max_num_batched_tokens=8)
    runner = llm.llm_engine.executor.model_runner
    seen = []
    forward = runner.forward

    def noting_forward(step):
        batch = step.batch
        rows = 0 if batch.prompt is None else len(batch.prompt.rows)
        assert len(batch.logits_indices) == sum(batch.num_positions()) + rows
        seen.append(batch.prompt)
        return forward(step)

    runner.forward = noting_forward
    llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert seen and all(prompt is None for prompt in seen)
    seen.clear()
    asked = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1)
    llm.generate(PROMPTS[:1], asked, use_tqdm=False)
    assert sum(len(prompt.rows) for prompt in seen if prompt is not None) == len(PROMPTS[0]) - 1
    assert seen[-1] is None  # decodes after the list went out: the old path


def test_short_prompts_large_k_and_bad_values(tmp_path) -> None:
    hf = build_checkpoint("qwen3", tmp_path)
    llm = LLM(tmp_path, dtype="float32", block_size=4)
    one, two = [5], [5, 9]
    outs = llm.generate(
        [one, two],
        [
            SamplingParams(max_tokens=2, prompt_logprobs=4),
            SamplingParams(prompt_logprobs=VOCAB + 7),
        ],
        use_tqdm=False,
    )
    assert outs[0].prompt_logprobs == [None]
    assert outs[1].prompt_logprobs[0] is None and len(outs[1].prompt_logprobs[1]) == VOCAB
    assert_matches(outs[1].prompt_logprobs, two, hf_logprobs(hf, two), VOCAB)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)


def test_completions_accept_vllms_prompt_logprobs(tmp_path) -> None:
    hf = build_checkpoint("qwen3", tmp_path)
    config = EngineConfig(model=str(tmp_path), dtype="float32", block_size=4, max_model_len=96)
    prompt = PROMPTS[1]
    with in_thread(build_app(ServerConfig(config))) as url:
        body = {"model": tmp_path.name, "prompt": prompt, "max_tokens": 2, "prompt_logprobs": 2}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
        plain = httpx.post(url + "/v1/completions", json={**body, "prompt_logprobs": None})
        bad = httpx.post(url + "/v1/completions", json={**body, "prompt_logprobs": -1})
    assert reply.status_code == 200, reply.text
    shown = reply.json()["choices"][0]["prompt_logprobs"]
    entries = [None] + [{int(t): v["logprob"] for t, v in e.items()} for e in shown[1:]]
    assert shown[0] is None
    assert all(isinstance(v["decoded_token"], str) for e in shown[1:] for v in e.values())
    assert_matches(entries, prompt, hf_logprobs(hf, prompt), 2)
    assert plain.status_code == 200 and "prompt_logprobs" not in plain.json()["choices"][0]
    assert bad.status_code == 400 and "prompt_logprobs" in bad.text
