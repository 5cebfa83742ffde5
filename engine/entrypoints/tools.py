"""Tool calls in chat, as vLLM serves them without a tool-call parser: the reply
is held to the tools' JSON schemas by the grammar, so it is a call by
construction and nothing has to be found in free text.

    tool_choice "none"          the tools go to the chat template; the reply is text
    tool_choice {"function": F} the reply is F's arguments: JSON under F's parameters schema
    tool_choice "required"      the reply is a JSON array of one or more
                                {"name": ..., "parameters": {...}}, each under its tool's schema
    tool_choice "auto"          refused: telling a call from text needs a parser for the
                                model's own call format, and this server has none

Either constrained reply comes back as OpenAI's ``tool_calls`` with finish_reason
"tool_calls"; in a stream, a named call's arguments as they come, and each of a
required reply's calls once its JSON object is whole.
"""

from __future__ import annotations

import json
import uuid
from contextlib import suppress
from dataclasses import dataclass, field

from engine.entrypoints.errors import bad_request
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
)
from engine.sampling_params import StructuredOutputsParams

ANY_OBJECT: dict = {"type": "object"}  # a tool without a parameters schema takes any object


@dataclass(frozen=True)
class ToolMode:
    """What a chat request's tools make of its reply: one named function's
    arguments (``name``), or an array of calls to any of ``schemas``."""

    schemas: dict[str, dict]  # each callable tool's parameters schema, by name
    name: str | None = None  # the named function, or None for "required"
    parallel: bool = True  # "required": more than one call allowed

    def schema(self) -> dict:
        """The JSON schema the reply is held to (vLLM's, for "required")."""
        if self.name is not None:
            return self.schemas[self.name]
        calls = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
            }
            for name, params in self.schemas.items()
        ]
        array: dict = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        return array | ({} if self.parallel else {"maxItems": 1})

    def constraint(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(json=self.schema())


def tool_mode(req: ChatCompletionRequest) -> ToolMode | None:
    """The request's tool choice, checked; None when the reply is plain text.
    A choice the server cannot serve is a 400 that says why."""
    tools = req.tools or []
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"  # OpenAI's default
    if choice == "none":
        return None
    if not tools:
        raise bad_request(f"tool_choice {_shown(choice)} needs a non-empty tools list", "tools")
    if choice == "auto":
        said = "" if req.tool_choice is not None else " (the default when tools are given)"
        raise bad_request(
            f'tool_choice "auto"{said} needs a tool-call parser to find calls in the '
            "model's free text, which this server does not configure; send tool_choice "
            '"required" or a named function (the reply is then held to the tools\' '
            'schemas), or "none"',
            "tool_choice",
        )
    schemas = {t.function.name: t.function.parameters or ANY_OBJECT for t in tools}
    if choice == "required":
        return ToolMode(schemas, parallel=req.parallel_tool_calls is not False)
    if choice.function.name not in schemas:
        raise bad_request(
            f"tool_choice names the function {choice.function.name!r}, which is not "
            "in tools: " + ", ".join(repr(n) for n in schemas),
            "tool_choice",
        )
    return ToolMode(schemas, name=choice.function.name)


def _shown(choice: object) -> str:
    return f'"{choice}"' if isinstance(choice, str) else "with a named function"


def template_call(call: ToolCall) -> dict:
    """An earlier call as chat templates read it, its arguments an object where
    they are JSON (templates write them with tojson), as vLLM passes them."""
    out = call.model_dump()
    with suppress(ValueError):  # not JSON: left as the text it is
        out["function"]["arguments"] = json.loads(call.function.arguments)
    return out


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCalls:
    """One choice's calls, read from its reply text as it grows: ``feed`` takes the
    text so far and returns what a stream sends next."""

    mode: ToolMode
    calls: list[ToolCall] = field(default_factory=list)
    read: int = 0  # characters of the text already turned into calls

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self.mode.name is not None:
            return self._feed_named(text)
        return self._feed_array(text)

    def _feed_named(self, text: str) -> list[ToolCallDelta]:
        """The call's arguments as they are written; its first delta carries its
        id, type and name too."""
        new = text[self.read :]
        self.read = len(text)
        if not self.calls:
            call = ToolCall(id=call_id(), function=FunctionCall(name=self.mode.name, arguments=new))
            self.calls.append(call)
            first = FunctionCallDelta(name=self.mode.name, arguments=new)
            return [ToolCallDelta(index=0, id=call.id, type="function", function=first)]
        if not new:
            return []
        self.calls[0].function.arguments += new
        return [ToolCallDelta(index=0, function=FunctionCallDelta(arguments=new))]

    def _feed_array(self, text: str) -> list[ToolCallDelta]:
        """Each element of the array once it is whole; the grammar makes the text
        a JSON array of call objects, so a prefix that does not decode is one
        still being written."""
        decoder, deltas = json.JSONDecoder(), []
        while True:
            self.read = start = _next_value(text, self.read)
            if start == len(text) or text[start] != "{":
                return deltas
            try:
                item, end = decoder.raw_decode(text, start)
            except json.JSONDecodeError:
                return deltas
            arguments = json.dumps(item["parameters"], ensure_ascii=False)
            call = ToolCall(
                id=call_id(), function=FunctionCall(name=item["name"], arguments=arguments)
            )
            self.calls.append(call)
            self.read = end
            function = FunctionCallDelta(name=item["name"], arguments=arguments)
            index = len(self.calls) - 1
            deltas.append(
                ToolCallDelta(index=index, id=call.id, type="function", function=function)
            )


def _next_value(text: str, pos: int) -> int:
    """Where the array's next element starts, past the brackets, commas and
    whitespace around the elements (the text's end if nothing follows yet)."""
    while pos < len(text) and text[pos] in "[], \t\n\r":
        pos += 1
    return pos
