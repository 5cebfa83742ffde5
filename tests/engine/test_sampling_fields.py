"""logit_bias, min_tokens, the three penalties and include_stop_str_in_output:
each changes the tokens or the text as vLLM defines it, checked against a
reference computed here (float64 adjusted logits, transformers' own logits), in
batches where other requests use none of them and keep their tokens."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.detokenizer import IncrementalDetokenizer
from engine.sample.penalties import prompt_mask
from engine.sample.sampler import Sampler, SamplingMetadata, SamplingRow, adjust_logits
from tests.engine.conftest import EOS, VOCAB, random_prompts


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def reference_penalties(
    logits: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams
) -> torch.Tensor:
    """vLLM's and OpenAI's definitions, in float64, one token at a time."""
    out = logits.double().clone()
    for t in range(out.shape[0]):
        count = output.count(t)
        if t in prompt or count:
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= p.frequency_penalty * count + p.presence_penalty * (count > 0)
    return out


def test_penalised_rows_match_a_float64_reference_and_plain_rows_are_untouched() -> None:
    g = torch.Generator().manual_seed(3)
    vocab = 50
    logits = torch.randn(5, vocab, generator=g) * 3
    prompt = [1, 2, 3, 3, 40]
    output = [2, 7, 7, 7, 9, 40]
    settings = [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(),  # plain
        SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
        SamplingParams(temperature=0),  # plain, greedy
        SamplingParams(presence_penalty=1.5, frequency_penalty=-1.0, repetition_penalty=0.6),
    ]
    mask = prompt_mask(prompt, vocab, torch.device("cpu"))
    rows = [SamplingRow(p, 0, 6, output if p.has_penalties else None, mask) for p in settings]
    md = SamplingMetadata.from_rows(rows, vocab, torch.device("cpu"))
    adjusted = adjust_logits(logits, md)
    for i, p in enumerate(settings):
        if p.has_penalties:
            want = reference_penalties(logits[i], prompt, output, p)
            assert torch.allclose(adjusted[i].double(), want, atol=1e-5)
            assert not torch.equal(adjusted[i], logits[i])
        else:
            assert torch.equal(adjusted[i], logits[i])
    # The logprobs stay the model's own: before the penalties.
    md.max_num_logprobs = 1
    out = Sampler()(logits, md)
    assert out.sampled_token_ids[3] == logits[3].argmax()
    assert torch.allclose(
        out.logprobs.logprobs[:, 0],
        logits.log_softmax(-1).gather(1, out.sampled_token_ids[:, None])[:, 0],
    )


def test_logit_bias_adds_and_min_tokens_holds_back_stop_tokens() -> None:
    logits = torch.zeros(3, 10)
    rows = [
        SamplingRow(greedy(logit_bias={4: 250.0, 5: -3.0}), 0, 0),  # 250: clamped to 100
        SamplingRow(greedy(min_tokens=2, stop_token_ids=[6]), 0, 1),  # step 1 < 2
        SamplingRow(greedy(min_tokens=2, stop_token_ids=[6]), 0, 2),  # step 2: free
    ]
    md = SamplingMetadata.from_rows(rows, 10, torch.device("cpu"), eos_token_ids=[9])
    adjusted = adjust_logits(logits, md)
    assert adjusted[0, 4] == 100.0 and adjusted[0, 5] == -3.0 and adjusted[0].sum() == 97.0
    assert adjusted[1, 6] == adjusted[1, 9] == float("-inf")
    assert torch.isfinite(adjusted[1, :6]).all() and torch.equal(adjusted[2], logits[2])
    assert (
        SamplingMetadata.from_rows(
            [SamplingRow(greedy(), 0, 0)], 10, torch.device("cpu")
        ).logit_bias
        is None
    )


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(qwen3[0], dtype="float32")


def hf_penalised_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:
    """Greedy on transformers' logits, penalised in float64 each step."""
    output: list[int] = []
    with torch.no_grad():
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1]
            output.append(int(reference_penalties(logits, prompt, output, p).argmax()))
    return output


PENALISED = [
    greedy(12, ignore_eos=True, repetition_penalty=1.8),
    greedy(12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.7),
]


PROMPTS = random_prompts(4, seed=81, low=3, high=12)
PARAMS = [PENALISED[0], greedy(12, ignore_eos=True), PENALISED[1], greedy(12, ignore_eos=True)]


@pytest.fixture(scope="module")
def penalised_reference(qwen3) -> list[list[int] | None]:
    """transformers' penalised greedy tokens for the rows of PARAMS with penalties."""
    return [
        hf_penalised_greedy(qwen3[1], prompt, p) if p.has_penalties else None
        for prompt, p in zip(PROMPTS, PARAMS)
    ]


@pytest.mark.parametrize("mode", ["sync", "async", "batch_invariant"])
def test_penalised_greedy_follows_the_reference_beside_plain_requests(
    qwen3, penalised_reference, mode
) -> None:
    kwargs = {
        "sync": {},
        "async": {"async_scheduling": True},
        "batch_invariant": {"batch_invariant": True, "attention_backend": "torch"},
    }[mode]
    llm = LLM(qwen3[0], dtype="float32", **kwargs)
    alone = [o.token_ids for o in llm.generate(PROMPTS, PARAMS[1], use_tqdm=False)]
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for p, out, free, want in zip(PARAMS, outs, alone, penalised_reference):
        if p.has_penalties:
            assert out.token_ids == want
            assert out.token_ids != free  # the penalty changed something
        else:
            assert out.token_ids == free


def test_sampled_requests_with_penalties_are_the_same_with_async_scheduling(qwen3) -> None:
    prompts = random_prompts(3, seed=82, low=3, high=12)
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=10, ignore_eos=True, **kw)
        for i, kw in enumerate([{"repetition_penalty": 0.2}, {}, {"frequency_penalty": -2.0}])
    ]
    runs = [
        [
            o.token_ids
            for o in LLM(qwen3[0], dtype="float32", async_scheduling=a).generate(
                prompts, params, use_tqdm=False
            )
        ]
        for a in (False, True)
    ]
    assert runs[0] == runs[1]
    unpenalised = [replace_penalties(p) for p in params]
    free = [
        o.token_ids
        for o in LLM(qwen3[0], dtype="float32").generate(prompts, unpenalised, use_tqdm=False)
    ]
    # Penalties that favour seen tokens change what is drawn; the plain row keeps its draws.
    assert free[1] == runs[0][1] and free[0] != runs[0][0] and free[2] != runs[0][2]


def replace_penalties(p: SamplingParams) -> SamplingParams:
    return SamplingParams(
        temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=True
    )


def test_logit_bias_makes_greedy_pick_a_token_or_drop_its_first_choice(llm) -> None:
    prompt = random_prompts(1, seed=83)[0]
    free = llm.generate([prompt], greedy(6, ignore_eos=True, logprobs=2), use_tqdm=False)[0]
    picked = llm.generate(
        [prompt], greedy(6, ignore_eos=True, logit_bias={17: 100}), use_tqdm=False
    )[0]
    assert picked.token_ids == [17] * 6
    first = free.token_ids[0]
    runner_up = sorted(free.logprobs[0], key=free.logprobs[0].get)[-2]  # of the raw top 2
    banned = greedy(1, ignore_eos=True, logit_bias={first: -100})
    assert llm.generate([prompt], banned, use_tqdm=False)[0].token_ids == [runner_up]
    with pytest.raises(ValueError, match=f"token id {VOCAB}"):
        llm.generate([prompt], greedy(logit_bias={VOCAB: 1.0}), use_tqdm=False)


def test_min_tokens_holds_eos_back_until_enough_tokens(llm) -> None:
    prompts = random_prompts(40, seed=41)
    outs = llm.generate(prompts, greedy(30, logprobs=2), use_tqdm=False)
    stopped = [(p, o) for p, o in zip(prompts, outs) if o.finish_reason == "stop"]
    assert stopped, "no prompt produced EOS; pick another seed"
    prompt, out = min(stopped, key=lambda po: len(po[1].token_ids))
    at = len(out.token_ids) - 1  # EOS came here
    assert out.token_ids[at] == EOS
    held = llm.generate([prompt], greedy(30, min_tokens=at + 3), use_tqdm=False)[0]
    assert held.token_ids[:at] == out.token_ids[:at]
    best_not_eos = max((t for t in out.logprobs[at] if t != EOS), key=out.logprobs[at].get)
    assert held.token_ids[at] == best_not_eos
    assert EOS not in held.token_ids[: at + 3]
    assert len(held.token_ids) > at + 3 or held.finish_reason == "length"


def test_min_tokens_holds_back_stop_token_ids_and_stop_strings(llm) -> None:
    prompt = random_prompts(1, seed=84)[0]
    free = llm.generate([prompt], greedy(12, ignore_eos=True), use_tqdm=False)[0]
    stop_id = free.token_ids[1]
    out = llm.generate(
        [prompt],
        greedy(12, ignore_eos=True, stop_token_ids=[stop_id], min_tokens=4),
        use_tqdm=False,
    )[0]
    assert stop_id not in out.token_ids[:4]
    assert out.finish_reason == "length" or out.token_ids[-1] == stop_id
    word = free.text[:3]
    early = llm.generate([prompt], greedy(12, ignore_eos=True, stop=[word]), use_tqdm=False)[0]
    assert early.text == "" and early.finish_reason == "stop"
    late = llm.generate(
        [prompt], greedy(12, ignore_eos=True, stop=[word], min_tokens=5), use_tqdm=False
    )[0]
    assert len(late.token_ids) > 5 and late.text.startswith(free.text[: len(late.text)])


def test_include_stop_str_in_output_keeps_the_stop_string(llm) -> None:
    prompt = random_prompts(1, seed=85)[0]
    free = llm.generate([prompt], greedy(16, ignore_eos=True), use_tqdm=False)[0]
    stop = free.text[4:7]
    cut = free.text.find(stop)
    kept = greedy(16, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    dropped = greedy(16, ignore_eos=True, stop=[stop])
    outs = llm.generate([prompt, prompt], [kept, dropped], use_tqdm=False)
    assert outs[0].text == free.text[: cut + len(stop)] and outs[0].text.endswith(stop)
    assert outs[1].text == free.text[:cut]


def test_a_stop_tokens_text_shows_only_with_include_stop_str() -> None:
    """As vLLM: a request that a stop token ended hides that token's text."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "c": 2}, unk_token="a"))
    for include, want in ((False, "ab"), (True, "abc")):
        detok = IncrementalDetokenizer(tok, [], stop=[], include_stop_str=include)
        detok.update([0, 1, 2], finished=True, stop_token=True)
        assert detok.text.replace(" ", "") == want


@pytest.mark.parametrize(
    "kw, needle",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": 5e-324}, "float32"),  # 0 in float32: logits / 0
        ({"repetition_penalty": 1e39}, "float32"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ],
)
def test_bad_settings_are_value_errors(kw, needle) -> None:
    with pytest.raises(ValueError, match=needle):
        SamplingParams(**kw)


def test_a_tiny_repetition_penalty_keeps_every_logit_finite() -> None:
    """A penalty within float32's range can still push a seen token's logit past
    its largest number: it is held there, not made +inf, which turned softmax into
    NaNs and sampled token 0 whatever the grammar allowed (the OpenAPI fuzzer's
    guided_choice ["0"] with repetition_penalty 5e-324 got a 500)."""
    logits = torch.tensor([[4.0, -3.0, 0.0, 2.0]])
    params = SamplingParams(repetition_penalty=1e-40)
    mask = prompt_mask([0, 1, 2], 4, torch.device("cpu"))
    md = SamplingMetadata.from_rows([SamplingRow(params, 0, 0, [], mask)], 4, torch.device("cpu"))
    out = adjust_logits(logits, md)
    assert out[0, 0] == torch.finfo(torch.float32).max  # 4 / 1e-40, held finite
    assert out[0, 2] == 0.0 and out[0, 3] == 2.0 and -1e-30 < out[0, 1] < 0  # -3 x 1e-40
    assert Sampler()(logits, md).sampled_token_ids[0] == 0
