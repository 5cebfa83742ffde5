"""langchain-openai's ChatOpenAI, unchanged, against the server: invoke, stream,
with_structured_output in each of its methods, and bind_tools."""

from __future__ import annotations

import json
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.server.clients.common import QUESTION, chat_text
from tests.server.clients.conftest import MODEL


class Weather(BaseModel):
    """The weather in a city."""

    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def llm(server):
    from langchain_openai import ChatOpenAI

    yield ChatOpenAI(
        model=MODEL,
        base_url=server.url + "/v1",
        api_key="none",
        temperature=0,
        max_tokens=64,  # a call in the tiny vocabulary takes about 40 tokens
        max_retries=0,
    )
    server.record("langchain")


def test_invoke_and_stream_give_the_servers_reply(llm, server) -> None:
    expected, _ = chat_text(server.url, 64)
    assert llm.invoke(QUESTION).content == expected
    assert "".join(chunk.content for chunk in llm.stream(QUESTION)) == expected


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_follows_the_schema(llm, method) -> None:
    parsed = llm.with_structured_output(Weather, method=method).invoke("Weather in Rome?")
    assert isinstance(parsed, Weather) and parsed.city in ("Paris", "Rome")


def test_structured_output_in_json_mode_is_json(llm) -> None:
    """json_mode holds the reply to a JSON object, not to the schema: the small
    model's object is whatever it writes, so only its JSON is checked."""
    out = llm.with_structured_output(Weather, method="json_mode", include_raw=True).invoke(
        "Weather in Rome? Answer in JSON."
    )
    raw = out["raw"]
    if raw.response_metadata["finish_reason"] == "stop":
        assert isinstance(json.loads(raw.content), dict)
    else:  # cut off by max_tokens: a JSON object's beginning
        assert raw.content.lstrip().startswith("{")


@pytest.mark.parametrize("choice", ["Weather", "any"])
def test_bind_tools_gets_tool_calls(llm, choice) -> None:
    message = llm.bind_tools([Weather], tool_choice=choice).invoke("Weather in Rome?")
    [call] = message.tool_calls
    assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome")
