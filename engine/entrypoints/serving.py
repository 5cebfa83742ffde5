"""The two generating endpoints: a request's prompts and choices become engine
requests, and their outputs become OpenAI's responses, whole or as a stream of
server-sent events ending in `data: [DONE]`."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from jinja2 import TemplateError
from pydantic import BaseModel
from starlette.responses import StreamingResponse

from engine.entrypoints.async_llm import AsyncLLM
from engine.entrypoints.chat_template import ChatTemplate
from engine.entrypoints.errors import OpenAIError, bad_request
from engine.entrypoints.kv_transfer import check_transfer, handoff_of, prefill_reply
from engine.entrypoints.prompt_tokens import PromptTokenizer
from engine.entrypoints.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatTool,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    KVTransferParams,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    TokenLogprob,
    TopLogprob,
    Usage,
)
from engine.entrypoints.token_text import TokenText
from engine.entrypoints.tools import ToolCalls, template_call, tool_mode
from engine.outputs import FinishReason, RequestOutput
from engine.sampling_params import SamplingParams, StructuredOutputsParams


@dataclass
class Choice:
    """One choice as it streams: how much of its output the client has seen."""

    index: int
    prompt_index: int
    text_sent: int = 0
    tokens_sent: int = 0
    last: RequestOutput | None = None
    tools: ToolCalls | None = None  # chat with tool_choice required or named: its calls


@dataclass
class Job:
    """One HTTP request's engine requests, by engine request id."""

    id: str  # the response's: cmpl-... or chatcmpl-...
    request_id: str  # the HTTP request's, as in X-Request-Id and the log
    prompts: list[list[int]]
    requests: dict[str, tuple[list[int], SamplingParams]] = field(default_factory=dict)
    choices: dict[str, Choice] = field(default_factory=dict)
    echo: list[str] | None = None  # completions' echo: each prompt's text, before its choices'
    transfer: KVTransferParams | None = None  # prefill/decode disaggregation (kv_transfer.py)
    prompt_only: bool = False  # max_tokens 0 with echo: the prompt alone (prompt_alone)

    def echoes(self, choice: Choice) -> bool:
        """Does the choice's next chunk start with its prompt? With echo, its first does."""
        return self.echo is not None and not choice.text_sent and not choice.tokens_sent

    def echoed(self, choice: Choice) -> str:
        """The prompt text a choice starts with: with echo, once, in its first chunk."""
        return self.echo[choice.prompt_index] if self.echoes(choice) else ""

    def usage(self) -> Usage:
        first = {c.prompt_index: c.last for c in reversed(self.choices.values())}
        prompt = sum(map(len, self.prompts))
        completion = sum(len(c.last.token_ids) for c in self.choices.values() if c.last)
        cached = sum(o.num_cached_tokens for o in first.values() if o is not None)
        return Usage(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )


_random = random.SystemRandom()
logger = logging.getLogger("deepinfer.server")


def prompt_alone(out: RequestOutput) -> RequestOutput:
    """A max_tokens 0 request's output: its prompt alone. The engine cannot run a
    request that samples nothing (SamplingParams needs max_tokens >= 1; the prompt
    logprobs come with the first sampled token), so it runs with max_tokens 1 and
    its one token is dropped here, from the text, the logprobs and the usage."""
    return replace(
        out,
        token_ids=[],
        text="",
        logprobs=[] if out.logprobs is not None else None,
        finish_reason=FinishReason.LENGTH if out.finished else None,
    )


def engine_prompt_logprobs(req: SamplingFields) -> int | None:
    """How many top logprobs the engine computes per prompt token: vLLM's
    prompt_logprobs, or with echo the completion's logprobs, whichever is more."""
    if not isinstance(req, CompletionRequest):
        return None
    wanted = [req.prompt_logprobs, req.logprobs if req.echo else None]
    return max((k for k in wanted if k is not None), default=None)


def joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def finish_reason(out: RequestOutput, tools: ToolCalls | None = None) -> str | None:
    """OpenAI's: a reply held to the tools' schemas that ended by itself made calls."""
    if not out.finished:
        return None
    if out.finish_reason == "length":
        return "length"
    return "tool_calls" if tools is not None else "stop"


def structured_outputs(req: SamplingFields) -> StructuredOutputsParams | None:
    """The one constraint a request puts on its output, from OpenAI's response_format
    or vLLM's structured_outputs or guided_* fields; a 400 for more than one."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    if isinstance(req, ChatCompletionRequest) and (tools := tool_mode(req)) is not None:
        found.append(("tool_choice", tools.constraint()))
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request(
                "response_format json_schema needs its json_schema", "response_format"
            )
        found.append(("response_format", StructuredOutputsParams(json=fmt.json_schema.schema_)))
    if (so := req.structured_outputs) is not None:
        kinds = dict(json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar)
        try:
            params = StructuredOutputsParams(
                **kinds, disable_any_whitespace=so.disable_any_whitespace
            )
        except ValueError as err:
            raise bad_request(str(err), "structured_outputs") from None
        found.append(("structured_outputs", params))
    guided = dict(
        json=req.guided_json,
        regex=req.guided_regex,
        choice=req.guided_choice,
        grammar=req.guided_grammar,
    )
    for kind, value in guided.items():
        if value is not None:
            try:
                found.append((f"guided_{kind}", StructuredOutputsParams(**{kind: value})))
            except ValueError as err:
                raise bad_request(str(err), f"guided_{kind}") from None
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"only one output constraint at a time, got {names}", found[1][0])
    return found[0][1] if found else None


def sampling_params(
    req: SamplingFields,
    max_tokens: int,
    seed: int,
    logprobs: int | None,
    structured: StructuredOutputsParams | None,
) -> SamplingParams:
    """One choice's engine settings, from the request's fields; a bad one is a 400."""
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            min_p=req.min_p,
            max_tokens=max_tokens,
            stop=req.stop_strings(),
            ignore_eos=req.ignore_eos,
            seed=seed,
            logprobs=logprobs,
            stop_token_ids=list(req.stop_token_ids or []),
            structured_outputs=structured,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty,
            min_tokens=req.min_tokens,
            logit_bias=logit_bias(req),
            include_stop_str_in_output=req.include_stop_str_in_output,
            prompt_logprobs=engine_prompt_logprobs(req),
        )
    except ValueError as err:
        raise bad_request(str(err), field_named(str(err))) from err


def field_named(message: str) -> str | None:
    """The request field a SamplingParams error starts with ("min_tokens must ..."), if any."""
    word = message.split(maxsplit=1)[0] if message else ""
    return word if word in SamplingFields.model_fields else None


def logit_bias(req: SamplingFields) -> dict[int, float] | None:
    """OpenAI's logit_bias, keyed by token ids written as strings ("50256"), as ints."""
    if req.logit_bias is None:
        return None
    bad = [key for key in req.logit_bias if not (key.isascii() and key.isdigit())]
    if bad:
        raise bad_request(f"logit_bias keys must be token ids, got {bad[0]!r}", "logit_bias")
    return {int(key): bias for key, bias in req.logit_bias.items()}


def running_usage(job: Job, req: SamplingFields) -> Usage | None:
    """vLLM's continuous_usage_stats: the request's usage so far, in every chunk."""
    options = req.stream_options
    return job.usage() if options is not None and options.continuous_usage_stats else None


def turn(message: ChatMessage) -> dict:
    """A message as a chat template reads it: OpenAI's developer role is a system
    message; an assistant's calls and a tool's call id as transformers passes them."""
    role = "system" if message.role == "developer" else message.role
    out: dict = {"role": role, "content": message.text()}
    if message.tool_calls:
        out["tool_calls"] = [template_call(call) for call in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    return out


def assistant_message(choice: Choice, out: RequestOutput) -> AssistantMessage:
    """A whole reply: its text, or with tools the calls it holds (and any text
    left over, a call cut off by max_tokens)."""
    if choice.tools is None:
        return AssistantMessage(content=out.text)
    choice.tools.feed(out.text)
    rest = out.text[choice.tools.read :].strip()
    return AssistantMessage(content=rest or None, tool_calls=choice.tools.calls)


def chat_delta(choice: Choice, out: RequestOutput) -> DeltaMessage | None:
    """What a stream sends of a choice's new output; None for nothing yet."""
    if choice.tools is None:
        return DeltaMessage(content=out.text[choice.text_sent :] or None)
    calls = choice.tools.feed(out.text)
    rest = out.text[choice.tools.read :].strip() if out.finished else ""
    if not calls and not rest and not out.finished:
        return None
    return DeltaMessage(content=rest or None, tool_calls=calls or None)


def sse(chunk: BaseModel | dict, null_usage: bool = False) -> str:
    """One server-sent event. With ``null_usage`` (stream_options.include_usage),
    a chunk without usage says "usage": null, as OpenAI's do."""
    if isinstance(chunk, BaseModel):
        if not (null_usage and "usage" in type(chunk).model_fields):
            return f"data: {chunk.model_dump_json(exclude_none=True)}\n\n"
        data = chunk.model_dump(mode="json", exclude_none=True)
        data.setdefault("usage", None)  # dropped with the other Nones
        return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
    return f"data: {json.dumps(chunk)}\n\n"


class OpenAIServing:
    def __init__(
        self, llm: AsyncLLM, model_names: list[str], chat_template: ChatTemplate | None
    ) -> None:
        self.llm = llm
        self.model_names = model_names
        self.chat_template = chat_template
        self.tokenizer = llm.tokenizer
        self.prompts = PromptTokenizer(llm.tokenizer, llm.max_model_len)
        self.token_text = TokenText(llm.tokenizer) if llm.tokenizer is not None else None

    # ------------------------------------------------------------ requests in

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise OpenAIError(  # OpenAI's status: the client raises NotFoundError
                404,
                f"the model {name!r} does not exist; this server serves "
                + ", ".join(repr(n) for n in self.model_names),
                param="model",
                code="model_not_found",
            )

    def job(
        self,
        kind: str,
        request_id: str,
        prompts: list[list[int]],
        req: SamplingFields,
        max_tokens: int | None,
        logprobs: int | None,
    ) -> Job:
        """An engine request per prompt and choice; bad settings are a 400."""
        job = Job(f"{kind}-{request_id}", request_id, prompts)
        limit = self.llm.max_model_len
        # Choice i draws with seed + i. Without a seed, a random one: the engine's
        # default would give every choice the same draws.
        seed = req.seed if req.seed is not None else _random.getrandbits(62)
        structured = structured_outputs(req)
        for p, ids in enumerate(prompts):
            if len(ids) >= limit:
                raise bad_request(
                    f"the prompt has {len(ids)} tokens, but this model's maximum context "
                    f"length is {limit} tokens, which leaves no room to generate",
                    "messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                )
            if max_tokens is not None and len(ids) + max_tokens > limit:
                raise bad_request(
                    f"this model's maximum context length is {limit} tokens, but "
                    f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, "
                    f"{max_tokens} for the completion)",
                    "max_tokens",
                )
            for i in range(req.n):
                index = p * req.n + i
                limited = max_tokens or limit - len(ids)
                params = sampling_params(req, limited, seed + i, logprobs, structured)
                engine_id = f"{job.id}-{index}"
                job.requests[engine_id] = (ids, params)
                job.choices[engine_id] = Choice(index, p)
        return job

    def start(self, job: Job) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Queue the job's requests now (a refusal is an error response, not a
        broken stream), and follow each output back to its choice."""
        n = len(job.choices) // len(job.prompts)  # choices per prompt
        repeats = [rid for rid, c in job.choices.items() if c.index % n]  # not a prompt's first
        handoff = handoff_of(job.transfer) if job.transfer is not None else None
        outputs = self.llm.generate(job.requests, repeats, handoff)
        if handoff is not None:  # what its client has seen already is not sent again
            [(rid, choice)] = job.choices.items()
            choice.text_sent = self.llm.processor.shown(rid)
            choice.tokens_sent = handoff.num_sent_tokens
        return self._follow(job, outputs)

    @staticmethod
    async def _follow(job: Job, outputs: AsyncIterator[RequestOutput]):
        async for out in outputs:
            out = prompt_alone(out) if job.prompt_only else out
            choice = job.choices[out.request_id]
            choice.last = out
            yield choice, out

    def stream(
        self, job: Job, chunks: AsyncIterator[BaseModel], usage: bool = False
    ) -> StreamingResponse:
        def render(event: BaseModel | OpenAIError) -> str:
            if isinstance(event, OpenAIError):
                return sse(event.body())
            return sse(event, null_usage=usage)

        events = self.events(job, chunks, render, end="data: [DONE]\n\n")
        return StreamingResponse(events, media_type="text/event-stream")

    async def events(
        self,
        job: Job,
        chunks: AsyncIterator,
        render: Callable[[Any], str],
        end: str | None,
    ) -> AsyncIterator[str]:
        """A job's events as server-sent events, ``render``ed; an error once the
        status is sent is an event too (``render`` gets the OpenAIError), then
        ``end``. Whatever ends the stream, the job's requests are aborted."""
        try:
            async for event in chunks:
                yield render(event)
        except OpenAIError as err:  # the status is sent already: say it in the stream
            err.request_id = job.request_id
            logger.error("request %s: %s", job.request_id, err.message)
            yield render(err)
        except Exception:  # a bug of ours: the same, with its traceback in the log
            logger.exception("request %s failed", job.request_id)
            message = f"internal server error (request id {job.request_id})"
            yield render(OpenAIError(500, message, request_id=job.request_id))
        finally:  # the client may have gone: stop what it no longer reads
            self.llm.abort(list(job.requests))
        if end is not None:
            yield end

    # ------------------------------------------------------------ logprobs

    def _token(self, token_id: int) -> str:
        return self.token_text.text(token_id) if self.token_text else str(token_id)

    def _bytes(self, token_id: int) -> list[int]:
        if self.token_text is None:
            return list(str(token_id).encode())
        return list(self.token_text.bytes(token_id))

    def _top(self, entry: dict[int, float], n: int) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[:n]

    def _top_keys(self, token_ids: list[int]) -> list[str]:
        if self.token_text is None:
            return [str(t) for t in token_ids]
        return self.token_text.top_keys(token_ids)

    def _top_dict(self, entry: dict[int, float], n: int) -> dict[str, float]:
        """A position's top n, keyed as completions' top_logprobs are."""
        top = self._top(entry, n)
        return dict(zip(self._top_keys([t for t, _ in top]), [v for _, v in top]))

    def completion_logprobs(
        self, out: RequestOutput, start: int, n: int, offset: int
    ) -> CompletionLogprobs:
        """OpenAI's legacy shape; top_logprobs keyed by text, n keys for n tokens
        even where two of them decode alike (TokenText.top_keys)."""
        lp = CompletionLogprobs()
        for token_id, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
            text = self._token(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(entry[token_id])
            lp.top_logprobs.append(self._top_dict(entry, n))
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def echo_logprobs(self, out: RequestOutput, n: int) -> CompletionLogprobs:
        """The prompt's tokens in the same shape, as vLLM echoes them: the first
        has no logprob (null, and null top_logprobs), each later one the model's
        given the tokens before it; text_offset from the start of the prompt."""
        lp, offset = CompletionLogprobs(), 0
        entries = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        for token_id, entry in zip(out.prompt_token_ids, entries):
            text = self._token(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if entry is None else entry[token_id])
            lp.top_logprobs.append(None if entry is None else self._top_dict(entry, n))
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def choice_logprobs(
        self, job: Job, choice: Choice, out: RequestOutput, n: int, start: int, shown: int
    ) -> CompletionLogprobs:
        """A chunk's logprobs, from token ``start`` and character ``shown`` of the
        output: with echo, the prompt's first, in the choice's first chunk, and
        the generated tokens' text_offset counted from the start of the echo."""
        if job.echo is None:
            return self.completion_logprobs(out, start, n, shown)
        echo = job.echo[choice.prompt_index]
        lp = self.completion_logprobs(out, start, n, len(echo) + shown)
        return joined(self.echo_logprobs(out, n), lp) if job.echoes(choice) else lp

    def prompt_logprobs(
        self, out: RequestOutput, k: int | None
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's shape: per prompt token, {token id: its logprob and text}, for
        the prompt's token and the top ``k`` (the engine may have computed more,
        for echo's logprobs)."""
        if out.prompt_logprobs is None or k is None:
            return None
        shown: list[dict[str, PromptLogprob] | None] = [None]  # the first token has none
        for token_id, entry in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
            kept = dict(self._top(entry, k))
            kept[token_id] = entry[token_id]
            shown.append(
                {
                    str(t): PromptLogprob(logprob=v, decoded_token=self._token(t))
                    for t, v in kept.items()
                }
            )
        return shown

    def chat_logprobs(self, out: RequestOutput, start: int, n: int) -> ChoiceLogprobs:
        """Each token's text and its own bytes, which for part of a character are
        not the bytes of its text ("\ufffd")."""
        content = []
        for token_id, entry in zip(out.token_ids[start:], (out.logprobs or [])[start:]):
            top = [
                TopLogprob(token=self._token(i), logprob=v, bytes=self._bytes(i))
                for i, v in self._top(entry, n)
            ]
            content.append(
                TokenLogprob(
                    token=self._token(token_id),
                    logprob=entry[token_id],
                    bytes=self._bytes(token_id),
                    top_logprobs=top,
                )
            )
        return ChoiceLogprobs(content=content)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer else ""

    # ------------------------------------------------------------ completions

    async def completions(self, req: CompletionRequest, request_id: str):
        self.check_model(req.model)
        prompt = req.prompt
        if not prompt:
            raise bad_request("prompt is empty", "prompt")
        batch = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
        prompts = [await self.prompts.encode(p) for p in batch]
        transfer, max_tokens = req.kv_transfer_params, req.max_tokens
        if max_tokens == 0 and not req.echo:
            raise bad_request(
                "max_tokens 0 is only allowed with echo (the prompt alone): "
                "without it there would be nothing to return",
                "max_tokens",
            )
        if transfer is not None:
            check_transfer(req, len(prompts), self.llm.kv_root is not None)
            max_tokens = 1 if transfer.do_remote_decode else max_tokens
        limit = 1 if max_tokens == 0 else max_tokens  # 0 runs as 1, its token dropped
        job = self.job("cmpl", request_id, prompts, req, limit, req.logprobs)
        job.transfer, job.prompt_only = transfer, max_tokens == 0
        outputs = self.start(job)
        if req.echo:  # once the engine took the prompts: their token ids are valid
            job.echo = [p if isinstance(p, str) else self._decode(p) for p in batch]
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return self.stream(job, self._completion_chunks(job, req, outputs, usage), usage)
        return await self._completion(job, req, outputs)

    async def _completion_chunks(
        self, job: Job, req: CompletionRequest, outputs: AsyncIterator, usage: bool
    ):
        async for choice, out in outputs:
            if len(out.text) == choice.text_sent and not out.finished:
                continue  # nothing new to show yet
            logprobs = None
            if req.logprobs is not None:
                logprobs = self.choice_logprobs(
                    job, choice, out, req.logprobs, choice.tokens_sent, choice.text_sent
                )
            text = job.echoed(choice) + out.text[choice.text_sent :]
            token_ids = out.token_ids[choice.tokens_sent :] if job.transfer is not None else None
            choice.text_sent, choice.tokens_sent = len(out.text), len(out.token_ids)
            item = CompletionChoice(
                index=choice.index,
                text=text,
                logprobs=logprobs,
                finish_reason=finish_reason(out),
                token_ids=token_ids,
            )
            yield CompletionResponse(
                id=job.id, model=req.model, choices=[item], usage=running_usage(job, req)
            )
        if usage:
            yield CompletionResponse(id=job.id, model=req.model, choices=[], usage=job.usage())

    async def _completion(
        self, job: Job, req: CompletionRequest, outputs: AsyncIterator
    ) -> CompletionResponse:
        async for _ in outputs:
            pass
        choices = []
        for choice in sorted(job.choices.values(), key=lambda c: c.index):
            out = choice.last
            logprobs = None
            if req.logprobs is not None:
                logprobs = self.choice_logprobs(job, choice, out, req.logprobs, 0, 0)
            choices.append(
                CompletionChoice(
                    index=choice.index,
                    text=job.echoed(choice) + out.text,
                    logprobs=logprobs,
                    finish_reason=finish_reason(out),
                    prompt_logprobs=self.prompt_logprobs(out, req.prompt_logprobs),
                )
            )
        reply = None
        if job.transfer is not None and job.transfer.do_remote_decode:
            [(_, params)], [choice] = job.requests.values(), job.choices.values()
            reply = prefill_reply(choice.last, params.seed, self.llm.kv_root, self.llm.block_size)
        return CompletionResponse(
            id=job.id, model=req.model, choices=choices, usage=job.usage(), kv_transfer_params=reply
        )

    # ------------------------------------------------------------ chat

    async def chat(self, req: ChatCompletionRequest, request_id: str):
        self.check_model(req.model)
        if self.chat_template is None:
            raise bad_request("this model has no chat template; use /v1/completions")
        tools = tool_mode(req)
        text = self.render_chat(req.messages, req.add_generation_prompt, req.tools)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        # The template writes the special tokens it wants (vLLM's default for chat).
        prompt = await self.prompts.encode(text, "messages", add_special_tokens=False)
        job = self.job("chatcmpl", request_id, [prompt], req, max_tokens, logprobs)
        for choice in job.choices.values():
            choice.tools = ToolCalls(tools) if tools is not None else None
        outputs = self.start(job)
        if req.stream:
            usage = req.stream_options is not None and req.stream_options.include_usage
            return self.stream(job, self._chat_chunks(job, req, outputs, usage), usage)
        return await self._chat(job, req, outputs)

    def render_chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[ChatTool] | None = None,
    ) -> str:
        """The prompt the chat template renders for ``messages`` (OpenAI's developer
        role is a system message) and ``tools``, as transformers passes them; a
        template's refusal is a 400. Needs a template."""
        assert self.chat_template is not None
        turns = [turn(m) for m in messages]
        listed = [t.model_dump(exclude_none=True) for t in tools] if tools else None
        try:
            return self.chat_template.render(turns, add_generation_prompt, listed)
        except TemplateError as err:
            raise bad_request(f"the chat template refused the messages: {err}", "messages") from err

    def _chunk(self, job: Job, req: ChatCompletionRequest, **kw) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=job.id, model=req.model, **kw)

    async def _chat_chunks(
        self, job: Job, req: ChatCompletionRequest, outputs: AsyncIterator, usage: bool
    ):
        for choice in sorted(job.choices.values(), key=lambda c: c.index):
            delta = DeltaMessage(role="assistant", content="")
            first = ChatChunkChoice(index=choice.index, delta=delta)
            yield self._chunk(job, req, choices=[first], usage=running_usage(job, req))
        async for choice, out in outputs:
            if len(out.text) == choice.text_sent and not out.finished:
                continue
            delta = chat_delta(choice, out)
            if delta is None:
                continue  # a call still being written
            logprobs = None
            if req.logprobs:
                logprobs = self.chat_logprobs(out, choice.tokens_sent, req.top_logprobs or 0)
            choice.text_sent, choice.tokens_sent = len(out.text), len(out.token_ids)
            item = ChatChunkChoice(
                index=choice.index,
                delta=delta,
                logprobs=logprobs,
                finish_reason=finish_reason(out, choice.tools),
            )
            yield self._chunk(job, req, choices=[item], usage=running_usage(job, req))
        if usage:
            yield self._chunk(job, req, choices=[], usage=job.usage())

    async def _chat(
        self, job: Job, req: ChatCompletionRequest, outputs: AsyncIterator
    ) -> ChatCompletionResponse:
        async for _ in outputs:
            pass
        choices = []
        for choice in sorted(job.choices.values(), key=lambda c: c.index):
            out = choice.last
            logprobs = self.chat_logprobs(out, 0, req.top_logprobs or 0) if req.logprobs else None
            choices.append(
                ChatChoice(
                    index=choice.index,
                    message=assistant_message(choice, out),
                    logprobs=logprobs,
                    finish_reason=finish_reason(out, choice.tools),
                )
            )
        return ChatCompletionResponse(
            id=job.id, model=req.model, choices=choices, usage=job.usage()
        )
