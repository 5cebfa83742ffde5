"""Property-based requests from the server's own /openapi.json (schemathesis):
valid and invalid bodies for every operation, a bounded number of each. No
response may be a server error, every error must be OpenAI's error object, and
every successful completion must parse as the response the schema promises."""

from __future__ import annotations

import json

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.core.transport import DEFAULT_MAX_STREAM_EVENTS

from engine.entrypoints.protocol import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
    ErrorResponse,
)
from tests.server.conftest import auth

# Examples per operation: 300 in all for the two that generate. The others take
# no input, so one example each is all there is.
EXAMPLES = {"/v1/completions": 150, "/v1/chat/completions": 150}
OTHER_EXAMPLES = 5
RESPONSES = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionResponse}
CHUNKS = {"/v1/completions": CompletionResponse, "/v1/chat/completions": ChatCompletionChunk}


def check(path: str, response) -> None:
    status = response.status_code
    assert status < 500, f"{status} from {path}: {response.text[:500]}"
    if status >= 400:
        ErrorResponse.model_validate_json(response.text)  # OpenAI's error object
        return
    if path not in RESPONSES:
        return
    if "text/event-stream" in str(response.headers.get("content-type")):
        events = response.text.split("\n\n")
        if len(events) - 1 < DEFAULT_MAX_STREAM_EVENTS:  # else schemathesis hung up
            assert events[-2:] == ["data: [DONE]", ""], response.text[-300:]
        for event in events[:-1]:
            if event == "data: [DONE]":
                continue
            payload = json.loads(event.removeprefix("data: "))
            if "error" in payload:
                raise AssertionError(f"error in a stream from {path}: {payload}")
            CHUNKS[path].model_validate(payload)
    else:
        RESPONSES[path].model_validate_json(response.text)


LIMITS = ("max_tokens", "max_completion_tokens")


def served_model(case):
    """A valid request names the model that is served (any other name is a 400,
    which the invalid requests cover), so that it reaches the engine. A chat with
    no limit on its length generates until the context is full, a second or more
    here, and the fuzzer sends many: they get a short limit, and the openai client's
    tests send one without (test_a_chat_without_a_limit_fills_the_context)."""
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = "deepinfer-tiny"
        if "messages" in case.body and not any(k in case.body for k in LIMITS):
            case.body["max_completion_tokens"] = 4
    return case


def fuzz(op, examples: int, url: str) -> None:
    """``examples`` requests to one operation, valid and invalid, each checked."""
    valid = op.as_strategy(GenerationMode.POSITIVE).map(served_model)
    cases = st.one_of(valid, op.as_strategy(GenerationMode.NEGATIVE))

    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: CI does not flake
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases)
    def run(case) -> None:
        check(op.path, case.call(base_url=url, headers=auth(), timeout=60))

    run()


def test_fuzzed_requests_get_no_server_error_and_openai_errors(server) -> None:
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= set(EXAMPLES) | {"/v1/models", "/health"}
    for op in operations:
        fuzz(op, EXAMPLES.get(op.path, OTHER_EXAMPLES), server.url)
