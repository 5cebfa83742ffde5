"""LiteLLM, unchanged, against the server as an OpenAI-compatible provider:
completion, text_completion, streaming, and response_format."""

from __future__ import annotations

import json
import os

import pytest

from tests.server.clients.common import QUESTION, chat_text, completion_text
from tests.server.clients.conftest import MODEL

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import


@pytest.fixture(scope="module")
def kw(server):
    yield {"api_base": server.url + "/v1", "api_key": "none", "temperature": 0}
    server.record("litellm")


def test_completion_and_its_stream(kw, server) -> None:
    import litellm

    messages = [{"role": "user", "content": QUESTION}]
    expected, _ = chat_text(server.url, 12)
    reply = litellm.completion(model=f"openai/{MODEL}", messages=messages, max_tokens=12, **kw)
    assert reply.choices[0].message.content == expected
    chunks = litellm.completion(
        model=f"openai/{MODEL}", messages=messages, max_tokens=12, stream=True, **kw
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected


def test_text_completion(kw, server) -> None:
    import litellm

    prompt = "def free(self"
    reply = litellm.text_completion(
        model=f"text-completion-openai/{MODEL}", prompt=prompt, max_tokens=6, **kw
    )
    assert reply.choices[0].text == completion_text(server.url, prompt, 6)


def test_response_format(kw) -> None:
    import litellm

    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
        "additionalProperties": False,
    }
    reply = litellm.completion(
        model=f"openai/{MODEL}",
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        max_tokens=24,
        response_format={"type": "json_schema", "json_schema": {"name": "w", "schema": schema}},
        **kw,
    )
    assert json.loads(reply.choices[0].message.content)["city"] in ("Paris", "Rome")
