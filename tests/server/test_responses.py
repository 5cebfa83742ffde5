"""`POST /v1/responses` with the official openai client's responses.create,
streamed and not: a Responses request is the chat request it means, so its text
and usage equal that chat's (greedy, deepinfer-tiny); the stream is the SDK's
event sequence; fields beyond text in and out are 400s that name them."""

from __future__ import annotations

import openai
import pytest

from tests.server.conftest import API_KEY

MODEL = "deepinfer-tiny"
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
CLOSING = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)


def chat_twin(client, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)


@pytest.mark.parametrize(
    "kw, messages",
    [
        ({"input": "What is a block?"}, [{"role": "user", "content": "What is a block?"}]),
        (
            {
                "instructions": "Answer briefly.",
                "input": [
                    {"role": "user", "content": "What is a block?"},
                    {"role": "assistant", "content": "A page."},
                    {"role": "user", "content": [{"type": "input_text", "text": "And a page?"}]},
                ],
            },
            [
                {"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": "What is a block?"},
                {"role": "assistant", "content": "A page."},
                {"role": "user", "content": "And a page?"},
            ],
        ),
    ],
    ids=["string", "instructions-and-messages"],
)
def test_a_response_is_its_chat_request(client, kw, messages) -> None:
    reply = client.responses.create(model=MODEL, max_output_tokens=9, temperature=0, **kw)
    twin = chat_twin(client, messages, max_completion_tokens=9)
    assert reply.object == "response" and reply.output[0].role == "assistant"
    assert reply.output_text == twin.choices[0].message.content
    assert reply.usage.input_tokens == twin.usage.prompt_tokens
    assert reply.usage.output_tokens == twin.usage.completion_tokens
    assert reply.usage.total_tokens == twin.usage.total_tokens
    cut = twin.choices[0].finish_reason == "length"
    assert reply.status == ("incomplete" if cut else "completed")
    if cut:
        assert reply.incomplete_details.reason == "max_output_tokens"
    assert reply.max_output_tokens == 9 and reply.temperature == 0


def test_a_streamed_response_is_the_sdks_events(client) -> None:
    kw = {"model": MODEL, "input": "What is a block?", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == EVENTS + ["response.output_text.delta"] * len(deltas) + CLOSING + [
        f"response.{whole.status}"
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == whole.output_text
    assert events[-4].text == whole.output_text
    final = events[-1].response
    assert final.output_text == whole.output_text and final.usage == whole.usage
    assert events[0].response.status == "in_progress"


def test_text_format_json_schema_is_response_format(client) -> None:
    fmt = {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}
    reply = client.responses.create(
        model=MODEL,
        input="Is a block a page?",
        max_output_tokens=20,
        temperature=0,
        text={"format": fmt},
    )
    twin = chat_twin(
        client,
        [{"role": "user", "content": "Is a block a page?"}],
        max_completion_tokens=20,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": SCHEMA},
        },
    )
    assert reply.output_text == twin.choices[0].message.content
    assert reply.output_text.lstrip().startswith("{")
    assert reply.text.format.type == "json_schema"


@pytest.mark.parametrize(
    "extra, field",
    [
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_what_is_beyond_text_is_refused_by_name(client, extra, field) -> None:
    kw = {"model": MODEL, "input": "hi", "max_output_tokens": 2} | extra
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**kw)
    assert field in err.value.body["message"]
    assert err.value.body["param"] == field


def test_neutral_values_are_taken(client) -> None:
    reply = client.responses.create(
        model=MODEL, input="hi", max_output_tokens=2, store=False, truncation="disabled"
    )
    assert reply.usage.output_tokens == 2


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"input": "block " * 200}, "input"),
        ({"input": "hi", "max_output_tokens": 1000}, "max_output_tokens"),
    ],
)
def test_refusals_name_the_responses_fields(client, kw, field) -> None:
    """The request runs as a chat, but a refusal names the field the client sent."""
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=MODEL, **kw)
    assert err.value.body["param"] == field
