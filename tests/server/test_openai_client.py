"""The official openai client, unchanged, against `deepinfer serve` on deepinfer-tiny."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY, SERVE_ARGS

MODEL = "deepinfer-tiny"
PROMPT = "def schedule(self"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list()] == [MODEL]


def test_completion_whole_and_streamed_agree(client) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage.completion_tokens == 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"


def test_chat_whole_and_streamed_agree_with_usage(client) -> None:
    messages = [
        {"role": "system", "content": "You answer questions about DeepInfer."},
        {"role": "user", "content": "What is a block?"},
    ]
    kw = dict(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0)
    whole = client.chat.completions.create(**kw)
    message = whole.choices[0].message
    assert message.role == "assistant" and message.content
    stream = client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        message.content
    )
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == 10
    assert usage.prompt_tokens == whole.usage.prompt_tokens  # its blocks now cached, though


def test_seed_reproduces_a_sampled_completion(client) -> None:
    kw = dict(model=MODEL, prompt="The KV cache", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(**kw, seed=7).choices[0].text
    b = client.completions.create(**kw, seed=7).choices[0].text
    others = {client.completions.create(**kw, seed=s).choices[0].text for s in (8, 9, 10)}
    assert a == b
    assert others - {a}, "different seeds should give some different text"


def test_n_choices_with_a_seed_differ_and_reproduce(client) -> None:
    kw = dict(model=MODEL, prompt="The KV cache", max_tokens=8, temperature=1.0, seed=3, n=3)
    first = [c.text for c in client.completions.create(**kw).choices]
    assert first == [c.text for c in client.completions.create(**kw).choices]
    assert len(set(first)) > 1
    single = client.completions.create(**{**kw, "n": 1}).choices[0].text
    assert first[0] == single  # choice i draws with seed + i


def test_stop_string_ends_the_text_before_it(client) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    full = client.completions.create(**kw).choices[0].text
    stop = full[len(full) // 2 :][:3]  # a string the greedy text does contain
    assert stop.strip(), full
    cut = client.completions.create(**kw, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full[: full.index(stop)]
    streamed = client.completions.create(**kw, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == cut.text


def test_usage_counts_cached_prompt_tokens(client) -> None:
    """The second of two identical long prompts finds its full blocks cached."""
    prompt = "The scheduler admits sequences while the token budget and blocks last. " * 3
    kw = dict(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    first = client.completions.create(**kw).usage
    second = client.completions.create(**kw).usage
    assert first.prompt_tokens == second.prompt_tokens > 32
    cached = second.prompt_tokens_details.cached_tokens
    assert cached >= 32 and cached % 16 == 0 and cached < second.prompt_tokens


def test_logprobs_of_the_chosen_tokens(client) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is a step?"}],
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == 4
    for token in content:
        tops = [t.logprob for t in token.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert token.logprob == tops[0]  # greedy: the chosen token is the most likely
    assert "".join(t.token for t in content) == out.choices[0].message.content


def test_completion_logprobs_whole_and_streamed(client) -> None:
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    choice = client.completions.create(**kw).choices[0]
    lp = choice.logprobs
    assert "".join(lp.tokens) == choice.text and len(lp.tokens) == 6
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) <= 2 and top[token] == logprob == max(top.values()) <= 0
    streamed = [c.choices[0].logprobs for c in client.completions.create(**kw, stream=True)]
    assert [t for s in streamed for t in s.tokens] == lp.tokens
    assert [v for s in streamed for v in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_n_streamed_choices_match_the_whole_response(client) -> None:
    kw = dict(model=MODEL, prompt="The KV cache", max_tokens=8, temperature=1.0, seed=5, n=3)
    whole = client.completions.create(**kw)
    texts = ["", "", ""]
    reasons: list[str | None] = [None] * 3
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
            reasons[c.index] = c.finish_reason or reasons[c.index]
    assert texts == [c.text for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]


def test_a_chat_without_a_limit_fills_the_context(client) -> None:
    """No max_tokens: the reply may run to the context's end (128 tokens on the
    tests' server), as OpenAI's default is."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "What is a block?"}])
    out = client.chat.completions.create(**kw, temperature=0, extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "length"
    assert out.usage.total_tokens == int(SERVE_ARGS[SERVE_ARGS.index("--max-model-len") + 1])


def test_a_wrong_api_key_is_refused(server) -> None:
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        wrong.models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "authentication_error"


def test_bad_requests_are_400s_the_client_understands(client) -> None:
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4o", prompt="hi")
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=4)
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=1).choices


def test_n_choices_without_a_seed_differ(client) -> None:
    """Unseeded choices get seeds of their own, not the same draws n times."""
    kw = dict(model=MODEL, prompt="The KV cache", max_tokens=8, temperature=1.0, n=4)
    assert len({c.text for c in client.completions.create(**kw).choices}) > 1
