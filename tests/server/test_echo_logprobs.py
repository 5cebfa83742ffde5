"""The request every evaluation harness scores with (lm-eval's loglikelihood):
/v1/completions with echo, logprobs and max_tokens 0. Each choice's text is its
prompt's, and its logprobs cover the prompt's tokens, the first null, each
later one the model's given the tokens before it, as vLLM returns them. The
oracle is the engine's own prompt_logprobs on the same model in float32, as the
session server runs it (SERVE_ARGS)."""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from tests.server.conftest import TINY, auth

MODEL = "deepinfer-tiny"
ATOL = 1e-5
TOP = 3  # logprobs: top entries per position
TEXT = "def fibonacci(n):\n    if n < 2:\n        return n"
CONTEXT = "def add(a, b):\n    return"
CONTINUATIONS = [" a + b", " a - b", " None"]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(TINY, dtype="float32", num_kv_blocks=64, max_model_len=128)


def engine_scores(llm: LLM, prompts: list, k: int = TOP) -> list[list[dict[int, float] | None]]:
    """The engine's own prompt logprobs for each prompt: {token id: logprob}."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=k)
    return [out.prompt_logprobs for out in llm.generate(prompts, params, use_tqdm=False)]


def complete(url: str, body: dict) -> dict:
    body = {"model": MODEL, "echo": True, "temperature": 0, **body}
    reply = httpx.post(url + "/v1/completions", json=body, headers=auth(), timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def streamed(url: str, body: dict) -> dict[int, tuple[str, dict, str]]:
    """Per choice index: the chunks' text and logprobs joined, and the finish reason."""
    body = {"model": MODEL, "echo": True, "temperature": 0, **body, "stream": True}
    choices: dict[int, tuple[str, dict, str]] = {}
    with httpx.stream(
        "POST", url + "/v1/completions", json=body, headers=auth(), timeout=120
    ) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if not line.startswith("data: {"):
                continue
            for c in json.loads(line.removeprefix("data: "))["choices"]:
                text, lp, reason = choices.get(c["index"], ("", {}, None))
                for key, values in (c.get("logprobs") or {}).items():
                    lp[key] = lp.get(key, []) + values
                choices[c["index"]] = (text + c["text"], lp, c.get("finish_reason") or reason)
    return choices


def assert_prompt_matches(lp: dict, ids: list[int], engine: list, tokenizer: Tokenizer) -> None:
    """The echoed logprobs of a prompt equal the engine's: the prompt's own
    token's, and the top TOP values; text_offset runs over the tokens' texts."""
    n = len(ids)
    assert lp["tokens"][:n] == [tokenizer.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    offsets = [0]
    for text in lp["tokens"][: n - 1]:
        offsets.append(offsets[-1] + len(text))
    assert lp["text_offset"][:n] == offsets
    for j in range(1, n):
        assert abs(lp["token_logprobs"][j] - engine[j][ids[j]]) <= ATOL, j
        want = sorted(engine[j].values(), reverse=True)[:TOP]
        got = sorted(lp["top_logprobs"][j].values(), reverse=True)
        assert len(got) == TOP and max(abs(a - b) for a, b in zip(got, want)) <= ATOL, j


@pytest.mark.parametrize("form", ["text", "token ids"])
def test_echoed_prompt_logprobs_equal_the_engines(server, llm, tokenizer, form) -> None:
    ids = tokenizer.encode(TEXT).ids
    prompt = TEXT if form == "text" else ids
    [engine] = engine_scores(llm, [prompt])
    reply = complete(server.url, {"prompt": prompt, "logprobs": TOP, "max_tokens": 2})
    [choice] = reply["choices"]
    lp = choice["logprobs"]
    assert choice["text"].startswith(tokenizer.decode(ids) if form == "token ids" else TEXT)
    assert len(lp["tokens"]) == len(ids) + 2 == len(lp["token_logprobs"])
    assert_prompt_matches(lp, ids, engine, tokenizer)
    # Then the generated tokens, their offsets counted from the start of the echo.
    assert all(v is not None for v in lp["token_logprobs"][len(ids) :])
    assert lp["text_offset"][len(ids)] == len(choice["text"]) - len(
        "".join(lp["tokens"][len(ids) :])
    )


def test_max_tokens_0_needs_echo_and_returns_the_prompt_alone(server, llm, tokenizer) -> None:
    ids = tokenizer.encode(TEXT).ids
    reply = complete(server.url, {"prompt": TEXT, "logprobs": 1, "max_tokens": 0})
    [choice] = reply["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert choice["logprobs"]["tokens"] == [tokenizer.decode([t]) for t in ids]
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["prompt_tokens"] == len(ids) == reply["usage"]["total_tokens"]
    plain = complete(server.url, {"prompt": TEXT, "max_tokens": 0})  # echo, no logprobs
    assert plain["choices"][0]["text"] == TEXT and plain["choices"][0]["logprobs"] is None
    body = {"model": MODEL, "prompt": TEXT, "max_tokens": 0}
    refused = httpx.post(server.url + "/v1/completions", json=body, headers=auth(), timeout=30)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "max_tokens" and "echo" in error["message"], error


def test_multiple_choice_as_lm_eval_scores_it(server, llm, tokenizer) -> None:
    """lm-eval's loglikelihood: context and continuation tokenized apart and
    joined, one prompt each, in one request; a continuation's score is the sum
    of its tokens' logprobs; the answer is the best score's."""
    context = tokenizer.encode(CONTEXT).ids
    prompts = [context + tokenizer.encode(c).ids for c in CONTINUATIONS]
    reply = complete(server.url, {"prompt": prompts, "logprobs": 1, "max_tokens": 0})
    choices = sorted(reply["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1, 2]
    served = [sum(c["logprobs"]["token_logprobs"][len(context) :]) for c in choices]
    own = [
        sum(entry[t] for t, entry in zip(p[len(context) :], lp[len(context) :]))
        for p, lp in zip(prompts, engine_scores(llm, prompts, 0))
    ]
    assert len(set(own)) == len(own)  # the argmax means something
    assert max(abs(a - b) for a, b in zip(served, own)) <= 1e-4
    assert served.index(max(served)) == own.index(max(own))


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_and_not_streamed_agree(server, tokenizer, max_tokens) -> None:
    body = {"prompt": [TEXT, CONTEXT], "logprobs": 2, "max_tokens": max_tokens}
    whole = {c["index"]: c for c in complete(server.url, body)["choices"]}
    stream = streamed(server.url, body)
    assert sorted(stream) == sorted(whole) == [0, 1]
    for index, prompt in enumerate([TEXT, CONTEXT]):
        text, lp, reason = stream[index]
        want = whole[index]
        assert text == want["text"] and text.startswith(prompt)
        assert reason == want["finish_reason"]
        expected = want["logprobs"]
        n = len(tokenizer.encode(prompt).ids) + max_tokens
        assert len(lp["tokens"]) == n and lp["tokens"] == expected["tokens"]
        assert lp["text_offset"] == expected["text_offset"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for got, exp in zip(lp["token_logprobs"][1:], expected["token_logprobs"][1:]):
            assert abs(got - exp) <= ATOL
        for got, exp in zip(lp["top_logprobs"][1:], expected["top_logprobs"][1:]):
            assert got.keys() == exp.keys()
