"""Tool calls through the grammar (engine/entrypoints/tools.py), with the official
openai client: tool_choice "none" ignores the tools, a named function's and
"required"'s replies are held to the tools' schemas and come back as tool_calls
(streamed as deltas, finish_reason "tool_calls"), and "auto" is refused by name.

The server runs with --disable-any-whitespace: under a grammar that allows it,
the random-weight model writes whitespace until max_tokens (issue 47, item 4)."""

from __future__ import annotations

import json

import openai
import pytest

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from engine.entrypoints.chat_template import ChatTemplate
from engine.entrypoints.protocol import ChatMessage
from engine.entrypoints.serving import turn
from tests.server.conftest import TINY, in_thread

MODEL = "deepinfer-tiny"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ENUMS = {"get_weather": ("city", {"Paris", "Rome"}), "get_time": ("zone", {"UTC", "CET"})}
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def client():
    config = EngineConfig(
        model=str(TINY), dtype="float32", num_kv_blocks=256, disable_any_whitespace=True
    )
    with in_thread(build_app(ServerConfig(config))) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)


def ask(client, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=40, temperature=0, **kw
    )


def check_call(name: str, arguments: str) -> None:
    """A call to a known tool whose arguments meet its schema."""
    key, allowed = ENUMS[name]
    assert json.loads(arguments) == {key: json.loads(arguments)[key]}
    assert json.loads(arguments)[key] in allowed


def streamed_calls(client, **kw) -> tuple[list[tuple[str, str]], str, str]:
    """(name, arguments) per call, joined from a stream's deltas by index, as the
    openai client's users join them; the finish reason; the text content."""
    calls: dict[int, list[str]] = {}
    ids: dict[int, str] = {}
    reason, content = None, ""
    for chunk in ask(client, stream=True, **kw):
        for c in chunk.choices:
            content += c.delta.content or ""
            indexes = [d.index for d in c.delta.tool_calls or []]
            assert len(indexes) == len(set(indexes)), "one delta per call in a chunk"
            for d in c.delta.tool_calls or []:
                if d.id is not None:
                    assert d.index not in ids, "a call's id comes with its first delta only"
                    ids[d.index] = d.id
                    calls[d.index] = [d.function.name, ""]
                calls[d.index][1] += d.function.arguments or ""
            reason = c.finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], reason, content


def test_tool_choice_none_ignores_the_tools(client) -> None:
    plain = ask(client)
    with_tools = ask(client, tools=[WEATHER], tool_choice="none")
    assert with_tools.choices[0].message.tool_calls is None
    assert with_tools.choices[0].message.content == plain.choices[0].message.content
    assert with_tools.choices[0].finish_reason == plain.choices[0].finish_reason


def test_a_named_function_gets_arguments_under_its_schema(client) -> None:
    reply = ask(client, tools=[WEATHER, TIME], tool_choice=NAMED)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    check_call(call.function.name, call.function.arguments)
    calls, reason, content = streamed_calls(client, tools=[WEATHER, TIME], tool_choice=NAMED)
    assert calls == [(call.function.name, call.function.arguments)] and reason == "tool_calls"
    assert content == ""


def test_required_gets_a_call_to_one_of_the_tools(client) -> None:
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False}
    choice = ask(client, **kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call.function.name, call.function.arguments)
    calls, reason, content = streamed_calls(client, **kw)
    assert calls == [(call.function.name, call.function.arguments)]
    assert reason == "tool_calls" and content == ""


def test_parallel_calls_stream_each_once_it_is_whole(client) -> None:
    """The small model repeats its call until max_tokens: each whole one is a
    call, and the one cut off is left as text, in a stream as in a whole reply."""
    kw = {"tools": [WEATHER, TIME], "tool_choice": "required"}
    choice = ask(client, **kw).choices[0]
    assert len(choice.message.tool_calls) >= 1
    for call in choice.message.tool_calls:
        check_call(call.function.name, call.function.arguments)
    calls, reason, content = streamed_calls(client, **kw)
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert reason == choice.finish_reason and content == (choice.message.content or "")


@pytest.mark.parametrize("choice", ["auto", None])
def test_auto_is_refused_by_name(client, choice) -> None:
    kw = {"tool_choice": choice} if choice else {}
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, tools=[WEATHER], **kw)
    message = err.value.body["message"]
    assert '"auto"' in message and "tool-call parser" in message and "at most" not in message
    assert err.value.body["param"] == "tool_choice"


@pytest.mark.parametrize(
    "kw, field, words",
    [
        ({"tool_choice": "required"}, "tools", "non-empty tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tool_choice",
            "'f'",
        ),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            "response_format",
            "only one output constraint",
        ),
    ],
)
def test_bad_tool_requests_are_400s_that_say_why(client, kw, field, words) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        ask(client, **kw)
    assert err.value.body["param"] == field and words in err.value.body["message"]


def test_the_template_reads_tools_and_earlier_calls() -> None:
    """As transformers passes them: tools as OpenAI's definitions, an assistant's
    calls with their arguments as an object, a tool message's call id."""
    source = (
        "{{ tools[0].function.name }}|"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }})"
        "{% endfor %}{{ m.tool_call_id or '' }};{% endfor %}"
    )
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    messages = [
        ChatMessage(role="user", content="weather?"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ]
    text = ChatTemplate(source, {}).render([turn(m) for m in messages], tools=[WEATHER])
    assert text == "get_weather|user:weather?;assistant:get_weather(Rome);tool:sunnycall_1;"


def test_content_may_be_null_only_beside_calls() -> None:
    with pytest.raises(ValueError, match="content is required"):
        ChatMessage(role="user", content=None)
