"""The request fields a user of OpenAI's API or vLLM's server expects, through the
official openai client: each either does what it says or is refused with a 400
that names it, never accepted and ignored."""

from __future__ import annotations

import json

import openai
import pytest

from tests.server.conftest import API_KEY

MODEL = "deepinfer-tiny"
CHAT = [{"role": "user", "content": "Is a block a page?"}]


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_response_format_json_schema_constrains_the_reply(client) -> None:
    schema = {"type": "string", "enum": ["yes", "no", "maybe"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
    for seed in range(3):
        reply = client.chat.completions.create(
            model=MODEL, messages=CHAT, response_format=fmt, seed=seed, max_tokens=16
        )
        assert json.loads(reply.choices[0].message.content) in schema["enum"]
        assert reply.choices[0].finish_reason == "stop"


def test_vllms_structured_outputs_and_guided_fields_constrain_the_reply(client) -> None:
    choices = ["paged", "contiguous"]
    # Room for the longest choice spelled one byte a token (sampling may spell it so), and
    # seeded, so that the reply does not depend on the run.
    longest = max(map(len, choices)) + 1
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        reply = client.completions.create(
            model=MODEL, prompt="The KV cache is", max_tokens=longest, seed=0, extra_body=extra
        )
        assert reply.choices[0].text in choices
        assert reply.choices[0].finish_reason == "stop"
    regex = {"guided_regex": "[0-9]{3}"}
    reply = client.completions.create(model=MODEL, prompt="n =", max_tokens=8, extra_body=regex)
    assert len(reply.choices[0].text) == 3 and reply.choices[0].text.isdigit()


def test_stop_token_ids_end_the_reply_at_that_token(client) -> None:
    kw = dict(model=MODEL, prompt="def schedule(self", max_tokens=8, temperature=0, logprobs=0)
    free = client.completions.create(**kw, extra_body={"ignore_eos": True})
    tokens = free.choices[0].logprobs.tokens
    assert len(tokens) == 8
    # The fourth token's id, as the server's tokenizer gives it.
    from tokenizers import Tokenizer

    from tests.server.conftest import TINY

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    ids = tok.encode("def schedule(self").ids
    full = tok.encode("def schedule(self" + free.choices[0].text).ids[len(ids) :]
    stop = full[3]
    first = full.index(stop)
    stopped = client.completions.create(
        **kw, extra_body={"ignore_eos": True, "stop_token_ids": [stop]}
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == first + 1


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"logit_bias": {"five": 10}}, "logit_bias"),
        ({"min_tokens": 3000}, "min_tokens"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"top_logprobs": 2}, "top_logprobs"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a+"},
            "only one output constraint",
        ),
        ({"guided_choice": [""]}, "choice"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "exactly one"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_unsupported_fields_and_bad_values_are_refused_by_name(client, extra, field) -> None:
    with pytest.raises(openai.BadRequestError, match=field):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body=extra)
