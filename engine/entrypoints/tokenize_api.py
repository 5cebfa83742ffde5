"""vLLM's tokenizer endpoints, which clients such as lm-eval-harness probe to
count and split text with the server's own tokenizer instead of fetching it
from a hub:

    POST /tokenize         text, or a chat's messages through the chat template, -> token ids
    POST /detokenize       token ids -> text
    GET  /tokenizer_info   the tokenizer's configuration (tokenizer_config.json's entries)

The ids are those the completions and chat endpoints feed the engine: the same
tokenizer, chat template and rendering (OpenAIServing.render_chat), and the same
encoding (PromptTokenizer.encode, in its threads beyond a few kilobytes). Unlike
them, /tokenize takes text longer than the context, as vLLM's does (a client
splits a long document into windows by its tokens). Like vLLM's, these
routes are at the root, outside /v1/, so the API key does not guard them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field, model_validator
from tokenizers import Tokenizer

from engine.entrypoints.errors import bad_request
from engine.entrypoints.protocol import ChatMessage
from engine.entrypoints.serving import OpenAIServing

# tokenizer_config.json's entries that name files of the checkpoint, which vLLM leaves out.
FILE_FIELDS = ("vocab_file", "merges_file")
# What transformers calls a tokenizer it builds from tokenizer.json alone.
DEFAULT_CLASS = "PreTrainedTokenizerFast"


class TokenizeRequest(BaseModel):
    """vLLM's two bodies in one: a ``prompt``, or a chat's ``messages`` rendered
    through the chat template as /v1/chat/completions renders them."""

    model: str | None = Field(None, description="optional, as in vLLM (lm-eval sends none)")
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = Field(True, description="with messages")
    add_special_tokens: bool | None = Field(
        None,
        description="the tokenizer's own special tokens; by default true with a prompt, "
        "false with messages (the chat template writes its own), as in vLLM",
    )
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None  # each token's vocabulary string (GPT-2's Ġ for a space)


class DetokenizeRequest(BaseModel):
    model: str | None = Field(None, description="optional, as in vLLM (lm-eval sends none)")
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """tokenizer_config.json's entries, special tokens as their text, as vLLM's
    /tokenizer_info gives the tokenizer's init_kwargs; the fields below always
    where the tokenizer has them."""

    model_config = ConfigDict(extra="allow")

    tokenizer_class: str
    model_max_length: int = Field(description="the server's max_model_len")
    bos_token: str | None = Field(None, exclude_if=lambda v: v is None)
    eos_token: str | None = Field(None, exclude_if=lambda v: v is None)
    pad_token: str | None = Field(None, exclude_if=lambda v: v is None)
    unk_token: str | None = Field(None, exclude_if=lambda v: v is None)
    chat_template: str | None = Field(None, exclude_if=lambda v: v is None)


def _tokenizer(serving: OpenAIServing, param: str | None = None) -> Tokenizer:
    if serving.tokenizer is None:
        raise bad_request("this model has no tokenizer", param)
    return serving.tokenizer


def render_chat(serving: OpenAIServing, req: TokenizeRequest) -> str:
    """The prompt the chat endpoint renders for these messages."""
    if serving.chat_template is None:
        raise bad_request("this model has no chat template", "messages")
    return serving.render_chat(req.messages or [], req.add_generation_prompt)


async def tokenize(serving: OpenAIServing, req: TokenizeRequest) -> TokenizeResponse:
    if req.model is not None:
        serving.check_model(req.model)
    encode = serving.prompts.encode  # as completions and chat encode, without the bound
    if req.prompt is not None:
        _tokenizer(serving, "prompt")
        special = req.add_special_tokens is not False
        ids = await encode(req.prompt, "prompt", add_special_tokens=special, bounded=False)
    else:
        special = req.add_special_tokens is True
        text = render_chat(serving, req)
        _tokenizer(serving, "messages")
        ids = await encode(text, "messages", add_special_tokens=special, bounded=False)
    strs = None
    if req.return_token_strs:
        tokenizer = _tokenizer(serving)
        strs = [tokenizer.id_to_token(t) or "" for t in ids]
    return TokenizeResponse(
        count=len(ids), max_model_len=serving.llm.max_model_len, tokens=ids, token_strs=strs
    )


def detokenize(serving: OpenAIServing, req: DetokenizeRequest) -> DetokenizeResponse:
    """The ids' text, special tokens included (vLLM's decode), so that it round-trips."""
    if req.model is not None:
        serving.check_model(req.model)
    tokenizer = _tokenizer(serving, "tokens")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    for t in req.tokens:
        if not 0 <= t < size or tokenizer.id_to_token(t) is None:
            raise bad_request(f"token id {t} is not in the vocabulary (0 to {size - 1})", "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens, skip_special_tokens=False))


def _as_text(value: Any) -> Any:
    """A saved AddedToken ({"content": ..., "special": ...}) as its text, at any depth."""
    if isinstance(value, dict):
        if isinstance(value.get("content"), str):
            return value["content"]
        return {k: _as_text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_text(v) for v in value]
    return value


def tokenizer_info(serving: OpenAIServing, model: Path) -> TokenizerInfoResponse:
    tokenizer = _tokenizer(serving)
    file = model / "tokenizer_config.json"
    saved = json.loads(file.read_text()) if file.is_file() else {}
    config = {name: _as_text(value) for name, value in saved.items()}
    for name in (*FILE_FIELDS, "chat_template"):
        config.pop(name, None)
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = config.get(name)
        if not isinstance(token, str) or tokenizer.token_to_id(token) is None:
            config.pop(name, None)  # null, or a token this tokenizer does not have
    config["tokenizer_class"] = config.get("tokenizer_class") or DEFAULT_CLASS
    config["model_max_length"] = serving.llm.max_model_len
    if serving.chat_template is not None:  # the one the chat endpoint renders
        config["chat_template"] = chat_template_source(model)
    return TokenizerInfoResponse(**config)


def chat_template_source(model: Path) -> str | None:
    """The template's text, from where load_chat_template takes it."""
    jinja_file = model / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    file = model / "tokenizer_config.json"
    source = json.loads(file.read_text()).get("chat_template") if file.is_file() else None
    if isinstance(source, list):  # several named templates: the default, as the server
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    return source


def tokenize_routes(serving: OpenAIServing, model: Path) -> APIRouter:
    """The three routes, for `app.include_router`."""
    router = APIRouter()

    @router.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize_route(body: TokenizeRequest) -> TokenizeResponse:
        return await tokenize(serving, body)

    @router.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize_route(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(serving, body)

    @router.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def tokenizer_info_route() -> TokenizerInfoResponse:
        return tokenizer_info(serving, model)

    return router
