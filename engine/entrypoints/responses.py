"""OpenAI's Responses API, `POST /v1/responses`, for text: a request becomes the
chat request it means (``instructions`` a system message before ``input``'s
messages) and runs as one, and its reply comes back as a Response, or streamed
as the SDK's events:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per new text),
    response.output_text.done, response.content_part.done,
    response.output_item.done, response.completed (response.incomplete when
    max_output_tokens cut it)

Nothing is stored (``store`` false, no ``previous_response_id``), and fields
beyond text in and out are refused by name: tools, reasoning, images, files.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import StreamingResponse

from engine.entrypoints.errors import OpenAIError, bad_request
from engine.entrypoints.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    JsonSchemaFormat,
    ResponseFormat,
)
from engine.entrypoints.serving import Job, OpenAIServing

# Fields the Responses API defines that the server takes at these values only
# (what a client that does not use them sends); any other field is refused.
NEUTRAL = {
    "store": (False,),
    "background": (False,),
    "truncation": ("disabled",),
    "parallel_tool_calls": (True, False),  # without tools it means nothing
    "tools": ([],),
    "tool_choice": ("none",),
    "include": ([],),
    "metadata": ({},),
}


# A chat field a refusal names, and the Responses field it came from.
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}


class InputText(BaseModel):
    type: Literal["input_text", "output_text"]  # an assistant's earlier turn: output_text
    text: str


class InputMessage(BaseModel):
    """A message of ``input``: EasyInputMessage, or a message item, with text."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class TextFormat(BaseModel):
    """``text.format``: plain text, any JSON object, or JSON under a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    format: TextFormat = TextFormat()
    verbosity: Literal["medium"] | None = None  # OpenAI's default, the only one taken


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # checked by name in refuse_the_rest

    model: str
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    stream: bool = False
    user: str | None = None

    def refuse_the_rest(self) -> None:
        """A 400 naming the first field beyond text in and out that is set."""
        for name, value in (self.model_extra or {}).items():
            if value is None or value in NEUTRAL.get(name, ()):
                continue
            raise bad_request(
                f"{name} is not supported by this server's /v1/responses, which takes "
                "text in and out: input, instructions, max_output_tokens, temperature, "
                "top_p, text.format and stream",
                name,
            )

    def chat(self) -> ChatCompletionRequest:
        """The chat request this one means."""
        messages = []
        if self.instructions is not None:
            messages.append(ChatMessage(role="system", content=self.instructions))
        if isinstance(self.input, str):
            messages.append(ChatMessage(role="user", content=self.input))
        else:
            messages += [ChatMessage(role=m.role, content=m.text()) for m in self.input]
        return ChatCompletionRequest(
            model=self.model,
            messages=messages,
            max_completion_tokens=self.max_output_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            response_format=response_format(self.text),
            user=self.user,
        )


def response_format(text: TextConfig | None) -> ResponseFormat | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema_ is None:
        raise bad_request("text.format json_schema needs its schema", "text")
    schema = JsonSchemaFormat(name=fmt.name, schema=fmt.schema_, strict=fmt.strict)
    return ResponseFormat(type="json_schema", json_schema=schema)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list = []


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    cached_tokens: int


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class Response(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete"]
    error: None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputMessage] = []
    parallel_tool_calls: bool = False
    temperature: float | None = None
    top_p: float | None = None
    tool_choice: Literal["none"] = "none"
    tools: list = []
    text: TextConfig = TextConfig()
    store: bool = False
    usage: ResponseUsage | None = None


class EventWriter:
    """Server-sent events as the Responses API writes them: the event's type as
    the SSE event name, a sequence number in each, and no [DONE]. An error after
    the status is sent is an "error" event."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, event: dict | OpenAIError) -> str:
        if isinstance(event, OpenAIError):
            info = event.body()["error"]
            event = {"type": "error", "code": info["code"], "message": info["message"]}
            event["param"] = info["param"]
        data = json.dumps(
            event | {"sequence_number": self.sequence}, default=_dumped, ensure_ascii=False
        )
        self.sequence += 1
        return f"event: {event['type']}\ndata: {data}\n\n"


def _dumped(model: BaseModel) -> dict:
    return model.model_dump(mode="json", by_alias=True)


class Responses:
    """The endpoint over the chat machinery of OpenAIServing."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def create(self, req: ResponsesRequest, request_id: str):
        try:
            return await self._create(req, request_id)
        except OpenAIError as err:  # the chat path names its own fields: name ours
            err.param = CHAT_TO_RESPONSES.get(err.param, err.param)
            raise

    async def _create(self, req: ResponsesRequest, request_id: str):
        req.refuse_the_rest()
        chat = req.chat()
        serving = self.serving
        serving.check_model(chat.model)
        if serving.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions")
        prompt = await serving.prompts.encode(
            serving.render_chat(chat.messages, True), "input", add_special_tokens=False
        )
        job = serving.job("resp", request_id, [prompt], chat, chat.max_completion_tokens, None)
        outputs = serving.start(job)
        shell = Response(
            id=job.id,
            status="in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=req.model,
            temperature=chat.temperature,
            top_p=chat.top_p,
            text=req.text or TextConfig(),
        )
        if req.stream:
            events = serving.events(job, self._events(job, shell, outputs), EventWriter(), None)
            return StreamingResponse(events, media_type="text/event-stream")
        text = ""
        async for _, out in outputs:
            text = out.text
        return finished(job, shell, text)

    async def _events(
        self, job: Job, shell: Response, outputs: AsyncIterator
    ) -> AsyncIterator[dict]:
        item_id = f"msg_{job.request_id}"
        where = {"item_id": item_id, "output_index": 0, "content_index": 0}
        item = OutputMessage(id=item_id, status="in_progress", content=[])
        yield {"type": "response.created", "response": shell}
        yield {"type": "response.in_progress", "response": shell}
        yield {"type": "response.output_item.added", "output_index": 0, "item": item}
        yield {"type": "response.content_part.added", **where, "part": OutputText(text="")}
        text = ""
        async for _, out in outputs:
            if len(out.text) > len(text):
                delta, text = out.text[len(text) :], out.text
                yield {
                    "type": "response.output_text.delta",
                    **where,
                    "delta": delta,
                    "logprobs": [],
                }
        done = finished(job, shell, text)
        [item] = done.output
        yield {"type": "response.output_text.done", **where, "text": text, "logprobs": []}
        yield {"type": "response.content_part.done", **where, "part": item.content[0]}
        yield {"type": "response.output_item.done", "output_index": 0, "item": item}
        yield {"type": f"response.{done.status}", "response": done}


def finished(job: Job, shell: Response, text: str) -> Response:
    """The Response once its one choice has finished."""
    [choice] = job.choices.values()
    cut = choice.last is not None and choice.last.finish_reason == "length"
    status = "incomplete" if cut else "completed"
    usage = job.usage()
    message = OutputMessage(
        id=f"msg_{job.request_id}", status=status, content=[OutputText(text=text)]
    )
    return shell.model_copy(
        update={
            "status": status,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if cut else None,
            "output": [message],
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                input_tokens_details=InputTokensDetails(
                    cached_tokens=usage.prompt_tokens_details.cached_tokens
                ),
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
            ),
        }
    )
