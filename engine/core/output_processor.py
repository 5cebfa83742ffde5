"""The front end's half of a step: each request's new tokens become what its
caller sees.

The output processor owns everything about a request that scheduling does not
need: its text, detokenized one token at a time, its stop strings, its logprobs
and its timings. It reads only EngineCoreOutputs, which are plain data, so the
server of Chapter 8 can run it in its front-end process, apart from the engine
core that schedules and runs the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenizers import Tokenizer

from engine.core.detokenizer import IncrementalDetokenizer
from engine.kv.handoff import Handoff
from engine.outputs import (
    EngineCoreEvent,
    EngineCoreOutput,
    FinishReason,
    RequestOutput,
    RequestTimes,
)
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class RequestState:
    """One request, as the front end follows it."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer | None  # None without a tokenizer: ids only
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once they arrive
    num_cached_tokens: int = 0
    times: RequestTimes = field(default_factory=lambda: RequestTimes(time.perf_counter()))
    events: list[EngineCoreEvent] = field(default_factory=list)  # what the scheduler did
    unshown: list[int] = field(default_factory=list)  # handed-on tokens not yet shown as text

    @property
    def final_only(self) -> bool:
        """Its caller reads only the final output, and no stop string needs the
        text as it grows: the text is spelled once, at the end."""
        return self.params.output_kind is RequestOutputKind.FINAL_ONLY and not self.params.stop


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput]
    reqs_to_abort: list[str]  # ended here by a stop string: the core must stop them too


class OutputSink(Protocol):
    """Where LLMEngine sends its requests' text side and each step's outputs: an
    OutputProcessor, or a server core's Outbox (entrypoints/engine_core.py), which
    keeps them for a front end that runs the OutputProcessor itself. The engine
    takes one when it is built and hands that one to every part that uses it."""

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handoff: Handoff | None = None,
    ) -> None: ...

    def abort_request(self, request_id: str) -> None: ...

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs: ...


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        handoff: Handoff | None = None,
    ) -> None:
        detokenizer = (
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop,
                params.min_tokens,
                params.include_stop_str_in_output,
            )
            if self.tokenizer is not None
            else None
        )
        state = RequestState(request_id, prompt, list(prompt_token_ids), params, detokenizer)
        if handoff is not None:  # continue where the sender's client left off
            state.token_ids = list(handoff.output_token_ids)
            sent = handoff.num_sent_tokens
            if detokenizer is not None:
                detokenizer.update(handoff.output_token_ids[:sent], finished=False)
            state.unshown = handoff.output_token_ids[sent:]
        self.states[request_id] = state

    def shown(self, request_id: str) -> int:
        """Characters of a handed-on request's text its client has seen already."""
        detok = self.states[request_id].detokenizer
        return len(detok.visible_text(False)) if detok is not None else 0

    def abort_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> ProcessedOutputs:
        """Fold each request's new tokens in; a request that ends is forgotten."""
        processed = ProcessedOutputs([], [])
        for out in outputs:
            state = self.states[out.request_id]
            reason = self._update(state, out)
            if reason == FinishReason.STOP and out.finish_reason is None:  # a stop string
                processed.reqs_to_abort.append(out.request_id)
            if reason is not None:
                del self.states[out.request_id]
            if reason is not None or state.params.output_kind is RequestOutputKind.CUMULATIVE:
                processed.request_outputs.append(self._request_output(state, reason))
        return processed

    def _update(self, state: RequestState, out: EngineCoreOutput) -> FinishReason | None:
        """The request's text, logprobs and timings; its finish reason, if it ended."""
        now = time.perf_counter()
        if state.times.first_token is None:
            state.times.first_token = now
        state.token_ids += out.new_token_ids
        state.num_cached_tokens = out.num_cached_tokens
        state.events += out.events
        n = state.params.logprobs
        state.logprobs += [logprob_entry(ids, values, n) for ids, values in out.new_logprobs or []]
        if out.prompt_logprobs is not None:  # the first token's output brings them, once
            k = state.params.prompt_logprobs
            state.prompt_logprobs = [None] + [
                logprob_entry(ids, values, k) for ids, values in out.prompt_logprobs
            ]
        reason = out.finish_reason
        detok = state.detokenizer
        stop_token = reason == FinishReason.STOP  # EOS, a stop token, a finished grammar
        if detok is not None and state.final_only:  # held until the end, spelled at once
            state.unshown += out.new_token_ids
            if reason is not None:
                detok.finish_at_once(state.unshown, stop_token)
        else:
            new, state.unshown = state.unshown + out.new_token_ids, []
            if detok is not None and detok.update(new, reason is not None, stop_token):
                reason = FinishReason.STOP  # a stop string: the text ends here; the core stops
        if reason is not None:
            state.times.finished = now
        return reason

    @staticmethod
    def _request_output(state: RequestState, reason: FinishReason | None) -> RequestOutput:
        finished = reason is not None
        detok = state.detokenizer
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            token_ids=list(state.token_ids),
            text=detok.visible_text(finished) if detok is not None else "",
            finished=finished,
            finish_reason=reason,
            logprobs=list(state.logprobs) if state.params.logprobs is not None else None,
            prompt_logprobs=state.prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            times=replace(state.times),
            events=list(state.events),
        )


def logprob_entry(ids: list[int], values: list[float], n: int) -> dict[int, float]:
    """One position's {token id: logprob}: the top ``n``, and the token at the
    position (column 0), which may be one of them."""
    entry = dict(zip(ids[1 : 1 + n], values[1 : 1 + n]))  # the top n...
    entry[ids[0]] = values[0]  # ...and the chosen token
    return entry
