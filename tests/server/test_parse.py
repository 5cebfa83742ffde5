"""The official openai client's chat.completions.parse, unchanged: it sends
response_format json_schema (strict) from a pydantic model and parses the reply
into it; on a --disable-any-whitespace server the small model's reply ends."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from tests.server.test_tools import client  # noqa: F401  (the fixture: that server)


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]


def test_parse_gives_the_model(client) -> None:  # noqa: F811
    reply = client.chat.completions.parse(
        model="deepinfer-tiny",
        messages=[{"role": "user", "content": "Weather in Rome for two days?"}],
        response_format=Weather,
        max_tokens=40,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Weather)
    assert Weather.model_validate_json(choice.message.content) == choice.message.parsed
