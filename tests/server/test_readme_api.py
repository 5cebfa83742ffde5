"""The README's "Every endpoint and request field" lists exactly what the code
serves: the app's routes, each request model's fields, every parameter the
official openai client's create methods can send (each one done or refused),
and the rows that say "refused" are the fields the server refuses."""

from __future__ import annotations

import inspect
import re

import pytest
from pydantic import BaseModel, ValidationError

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.protocol import (
    REFUSED,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from engine.entrypoints.responses import NEUTRAL, ResponsesRequest
from engine.entrypoints.tokenize_api import DetokenizeRequest, TokenizeRequest
from tests.conftest import ROOT
from tests.server.conftest import TINY

SECTION = "### Every endpoint and request field"
BOTH = "/v1/completions and /v1/chat/completions"
CHAT_MESSAGES = [{"role": "user", "content": "hi"}]
# A value beyond the neutral one, for each field a row says is refused.
REFUSING = {
    "suffix": "x",
    "best_of": 2,
    "store": True,
    "modalities": ["audio"],
    "verbosity": "high",
    "audio": {"voice": "alloy"},
    "prediction": {"type": "content"},
    "reasoning_effort": "low",
    "web_search_options": {},
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "moderation": "auto",
    "prompt_cache_options": {},
}
# The SDK's own arguments, not request fields.
NOT_FIELDS = {"self", "extra_headers", "extra_query", "extra_body", "timeout"}


def tables() -> dict[str, dict[str, str]]:
    """Each table of the section, by its first header cell: name -> description,
    a row's every backticked name in its first cell."""
    text = (ROOT / "README.md").read_text()
    section = text.split(SECTION, 1)[1].split("\n## ", 1)[0]
    found: dict[str, dict[str, str]] = {}
    for block in re.split(r"\n\s*\n", section):
        rows = [ln for ln in block.strip().splitlines() if ln.startswith("|")]
        if len(rows) < 3:
            continue
        title = rows[0].split("|")[1].strip().replace("`", "")
        found[title] = {}
        for row in rows[2:]:
            first, description = row.split("|")[1:3]
            for name in re.findall(r"`([^`]+)`", first) or [first.strip()]:
                found[title][name] = description.strip()
    return found


def fields(model: type[BaseModel]) -> set[str]:
    return {f.alias or name for name, f in model.model_fields.items()}


def sdk_params(method) -> set[str]:
    return set(inspect.signature(method).parameters) - NOT_FIELDS


def test_the_endpoints_are_the_apps_routes() -> None:
    config = EngineConfig(model=str(TINY), dtype="float32", num_kv_blocks=64)
    app = build_app(ServerConfig(config))
    paths = app.openapi()["paths"]  # every route the app serves, included routers too
    routes = {f"{method.upper()} {path}" for path, ops in paths.items() for method in ops}
    assert set(tables()["endpoint"]) == routes


@pytest.mark.parametrize(
    "title, expected",
    [
        (BOTH, fields(SamplingFields)),
        ("/v1/completions only", fields(CompletionRequest) - fields(SamplingFields)),
        ("/v1/chat/completions only", fields(ChatCompletionRequest) - fields(SamplingFields)),
        ("/v1/responses", fields(ResponsesRequest) | set(NEUTRAL) | {"any other field"}),
        ("/tokenize", fields(TokenizeRequest)),
        ("/detokenize", fields(DetokenizeRequest)),
    ],
)
def test_each_table_lists_the_models_fields(title, expected) -> None:
    assert set(tables()[title]) == expected


def test_every_field_the_openai_client_sends_is_listed() -> None:
    from openai.resources.chat.completions import Completions as Chat
    from openai.resources.completions import Completions

    t = tables()
    assert sdk_params(Chat.create) <= set(t[BOTH]) | set(t["/v1/chat/completions only"])
    assert sdk_params(Completions.create) <= set(t[BOTH]) | set(t["/v1/completions only"])


def test_the_responses_fields_it_does_not_list_are_refused_by_name() -> None:
    from openai.resources.responses import Responses

    listed = set(tables()["/v1/responses"])
    for name in sorted(sdk_params(Responses.create) - listed):
        req = ResponsesRequest(model="m", input="hi", **{name: "x"})
        with pytest.raises(OpenAIError) as err:
            req.refuse_the_rest()
        assert err.value.param == name and name in err.value.message


def test_the_rows_that_say_refused_are_refused() -> None:
    t = tables()
    said = {
        name
        for title in ("/v1/completions only", "/v1/chat/completions only")
        for name, description in t[title].items()
        if description.startswith("refused")
    }
    assert said == set(REFUSING) == set(REFUSED) | {"suffix", "best_of"}
    for name, value in REFUSING.items():
        model = CompletionRequest if name in ("suffix", "best_of") else ChatCompletionRequest
        body = {"prompt": "a"} if model is CompletionRequest else {"messages": CHAT_MESSAGES}
        with pytest.raises(ValidationError) as err:
            model(model="m", **body, **{name: value})
        assert err.value.errors()[0]["loc"] == (name,)
