"""The OpenAI request and response shapes the server speaks, as pydantic models.

They are the server's schema: FastAPI validates each request against them (a
field of the wrong type or out of range is a 400 that names it) and publishes
them at /openapi.json, which the tests fuzz. Fields OpenAI defines that the
engine cannot honour are accepted only at their neutral value, so a client
that sets one hears so instead of being silently ignored; fields OpenAI does
not define are ignored, as OpenAI and vLLM ignore them.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, Field, ValidationInfo, field_validator, model_validator

MAX_N = 16  # choices per request: each is one engine request


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, the usage so far in every chunk too, not only the last.
    continuous_usage_stats: bool = False

    @model_validator(mode="after")
    def _continuous_needs_usage(self) -> StreamOptions:
        if self.continuous_usage_stats and not self.include_usage:
            raise ValueError("continuous_usage_stats is only allowed with include_usage")
        return self


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: plain text, any JSON object, or JSON that follows a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's structured_outputs extension: one constraint on the output."""

    json_: dict | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    disable_any_whitespace: bool = False


class KVTransferParams(BaseModel):
    """What prefill/decode disaggregation passes between workers (vLLM's name;
    Chapter 8). To a prefill worker: do_remote_decode, and it runs the prompt,
    saves its blocks to the store and replies with these fields filled in. To a
    decode worker: the tokens generated so far, how many of them the client has
    seen, and the sender's block hashes (hex); it loads the blocks and goes on."""

    do_remote_decode: bool = False
    output_token_ids: list[int] | None = Field(None, min_length=1)
    num_sent_tokens: int = Field(0, ge=0)
    block_hashes: list[str] = Field(default_factory=list)
    seed: int | None = None  # in a prefill worker's reply: the seed its choice drew with


class SamplingFields(BaseModel):
    """What completions and chat share."""

    model: str
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None  # no cap, as vLLM: --max-body-bytes bounds it
    seed: int | None = None
    presence_penalty: float = Field(0, ge=-2, le=2)
    frequency_penalty: float = Field(0, ge=-2, le=2)
    user: str | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias, clamped to [-100, 100]"
    )
    # Extensions, with vLLM's names.
    top_k: int = Field(0, ge=-1, description="0 or -1: off")
    min_p: float = Field(0.0, ge=0, le=1)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = Field(None, max_length=64)
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: dict | str | None = None  # vLLM's older names for structured_outputs
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float = Field(1.0, gt=0)
    include_stop_str_in_output: bool = False
    kv_transfer_params: KVTransferParams | None = None

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: the prompt alone")
    logprobs: int | None = Field(None, ge=0, le=5)
    echo: bool = Field(
        False,
        description="the prompt's text before each choice's; with logprobs, the prompt "
        "tokens' logprobs before the generated ones' (the first token's null)",
    )
    suffix: None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=1, description="not supported beyond 1")
    # vLLM's extension: each prompt token's logprob and the top n, in each choice.
    prompt_logprobs: int | None = Field(None, ge=0, le=20)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str = ""  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = Field(
        None, description="may be null only in an assistant message with tool_calls"
    )
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required, unless an assistant message has tool_calls")
        return self

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema; none: any object")
    strict: bool | None = None  # the arguments always follow the schema: the grammar holds them


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


# Chat fields OpenAI defines that the engine does not do: the values that mean
# "not used", and why any other is refused.
REFUSED: dict[str, tuple[tuple, str]] = {
    "store": ((False,), "nothing is stored"),
    "modalities": ((["text"],), "the server writes text only"),
    "verbosity": (("medium",), "there is no verbosity setting; the model writes as it does"),
    "audio": ((), "the server writes text only"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "the models have no reasoning setting"),
    "web_search_options": ((), "there is no web search"),
    "functions": ((), "deprecated by OpenAI: use tools"),
    "function_call": ((), "deprecated by OpenAI: use tool_choice"),
    "moderation": ((), "there is no moderation"),
    "prompt_cache_options": ((), "the prefix cache has no options per request"),
}


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none, required or a named function (tools.py); auto is refused: it "
        "needs a tool-call parser",
    )
    parallel_tool_calls: bool | None = None  # with required: false allows one call
    # OpenAI's, taken as hints that change nothing here: one service tier, nothing
    # stored, a prefix cache keyed by the prompt itself, no moderation.
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # OpenAI's, refused beyond their neutral value (REFUSED says why).
    store: bool | None = None
    modalities: list[str] | None = None
    verbosity: str | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    web_search_options: dict | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    moderation: dict | str | None = None
    prompt_cache_options: dict | None = None
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True  # vLLM's extension

    @field_validator(*REFUSED)
    @classmethod
    def _refused(cls, value: object, info: ValidationInfo) -> object:
        neutral, why = REFUSED[info.field_name]
        if value is None or value in neutral:
            return value
        raise ValueError(f"{info.field_name} is not supported: {why}")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs is only allowed when logprobs is true")
        return self


# ------------------------------------------------------------------ responses


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class PromptLogprob(BaseModel):
    """One token of vLLM's prompt_logprobs (its Logprob, without the rank)."""

    logprob: float
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    # Per prompt token, keyed by token id; None for the first (vLLM's, not streamed).
    # Left out unless the request asked, so that OpenAI's choice keeps its shape.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(
        None, exclude_if=lambda v: v is None
    )
    # With kv_transfer_params: the tokens this chunk's text came from (vLLM's name).
    token_ids: list[int] | None = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    # A prefill worker's reply: what the decode worker needs (KVTransferParams).
    kv_transfer_params: KVTransferParams | None = Field(None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # Left out unless the request asked for calls, so that a text reply keeps its shape.
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=lambda v: v is None)


FinishReason = Literal["stop", "length", "tool_calls"]


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None  # with the call's first delta, as is its type and name
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "deepinfer"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    request_id: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
