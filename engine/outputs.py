"""What each stage of a step hands on: the model runner's sampled tokens to the
scheduler (ModelRunnerOutput), the engine core's news of each request to the
front end (EngineCoreOutput), and the front end's answer to the caller
(RequestOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, StrEnum, auto
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front end reads these outputs without importing torch
    import torch


@dataclass
class LogprobsTensors:
    """Per sampled row: column 0 is the chosen token, the rest the top tokens,
    most likely first, as many as the row that asked most wanted."""

    token_ids: torch.Tensor  # [rows, 1 + n] int64
    logprobs: torch.Tensor  # [rows, 1 + n] float32


Logprobs = tuple[list[int], list[float]]  # one token's: token ids and their logprobs


@dataclass
class TokenRow:
    """What one request gets from one step: the drafts it accepted, then the
    token sampled after the last of them (just that one, without drafts)."""

    token_ids: list[int]
    logprobs: list[Logprobs | None]  # per token; None where no request asked
    # Only in the step where a request that asked for prompt logprobs samples its
    # first token: one entry per prompt token after the first (the prompt's token
    # first, then the top ones), else None.
    prompt_logprobs: list[Logprobs] | None = None

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


@dataclass
class ModelRunnerOutput:
    """What one forward pass produced, for the scheduler to fold in. A request
    with k drafts samples k + 1 positions (its last token's and each draft's);
    they sit in ``sampled_token_ids`` one after the other, in request order."""

    req_ids: list[str]  # the requests that sampled this step, in row order
    sampled_token_ids: torch.Tensor  # [positions] int64, still on the device
    logprobs: LogprobsTensors | None = None  # per position; None when no request asked
    num_positions: list[int] | None = None  # per request, 1 + its drafts; None: 1 each
    num_accepted: torch.Tensor | None = None  # [requests] int64 drafts accepted; None: no drafts
    # Drafts the model runner's proposer made after each request's newest token
    # (runner/drafting.py): a list per request (prompt lookup, a draft model), or
    # [requests, k] int64 still on the device (MTP); None: no proposer.
    draft_token_ids: list[list[int]] | torch.Tensor | None = None
    # The proposer's confidence in each of those drafts, per request (None: it has none).
    draft_confidence: list[tuple[float, ...] | None] | None = None
    # Per request that asked for prompt logprobs and samples its first token this
    # step: a row per prompt token after the first, the prompt's token in column 0
    # (engine/sample/prompt_logprobs.py). None when no request's are due.
    prompt_logprobs: dict[str, LogprobsTensors] | None = None
    _rows: list[TokenRow] | None = field(default=None, init=False, repr=False, compare=False)

    def logprobs_lists(self) -> list[Logprobs | None]:
        """Each position's logprobs as host lists: (token ids, logprobs), or None."""
        if self.logprobs is None:
            return [None] * len(self.sampled_token_ids)
        return list(zip(self.logprobs.token_ids.tolist(), self.logprobs.logprobs.tolist()))

    def draft_rows(self) -> list[list[int]]:
        """Each request's drafts for its next step, on the host ([] each if none)."""
        if self.draft_token_ids is None:
            return [[] for _ in self.req_ids]
        if isinstance(self.draft_token_ids, list):
            return self.draft_token_ids
        return self.draft_token_ids.tolist()

    def token_rows(self) -> list[TokenRow]:
        """Each request's row of tokens, on the host: the step's one wait for the
        device (once: a proposer in the runner may have read them already)."""
        if self._rows is None:
            self._rows = self._token_rows()
        return self._rows

    def _token_rows(self) -> list[TokenRow]:
        tokens = self.sampled_token_ids.tolist()
        logprobs = self.logprobs_lists()
        counts = self.num_positions or [1] * len(self.req_ids)
        accepted = [0] * len(counts) if self.num_accepted is None else self.num_accepted.tolist()
        prompt = {
            req_id: list(zip(t.token_ids.tolist(), t.logprobs.tolist()))
            for req_id, t in (self.prompt_logprobs or {}).items()
        }
        rows, start = [], 0
        for req_id, n, a in zip(self.req_ids, counts, accepted):
            end = start + a + 1
            rows.append(TokenRow(tokens[start:end], logprobs[start:end], prompt.get(req_id)))
            start += n
        return rows


class EngineCoreEventType(Enum):
    QUEUED = auto()  # added to the waiting queue
    SCHEDULED = auto()  # admitted: its first time, or back after a preemption
    PREEMPTED = auto()  # sent back to the queue, its blocks freed


@dataclass(frozen=True, order=True)
class EngineCoreEvent:
    """Something the scheduler did to a request. ``index`` orders every event of
    every request: of two events in one step, the one with the lower index came first."""

    index: int  # first, so that events sort in the order they happened
    type: EngineCoreEventType = field(compare=False)
    step: int = field(compare=False)  # the engine step it happened in, counting from 1
    num_tokens: int = field(compare=False)  # the request's tokens at that moment
    time: float = field(compare=False)  # time.perf_counter() in the engine's process
    num_cached_tokens: int = field(default=0, compare=False)  # SCHEDULED: cached of them


class FinishReason(StrEnum):
    """Why a request ended. Each is its own text, as OpenAI's API spells it."""

    STOP = "stop"  # EOS, a stop token, a stop string, or a grammar with nothing left to add
    LENGTH = "length"  # max_tokens, or the end of the model's context
    ABORT = "abort"  # the caller gave up on it


@dataclass
class RequestTimes:
    """When a request reached each point, by the front end's clock
    (time.perf_counter, in seconds)."""

    arrival: float
    first_token: float | None = None
    finished: float | None = None


@dataclass
class EngineCoreOutput:
    """One request's news from one step, as the engine core hands it to the front
    end: plain data, so that the two can live in different processes."""

    request_id: str
    new_token_ids: list[int]
    # Per new token, if the request asked: token ids and their logprobs, the
    # chosen token first, then the top ones.
    new_logprobs: list[tuple[list[int], list[float]]] | None = None
    finish_reason: FinishReason | None = None  # set by the core: EOS, stop tokens, lengths, abort
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    events: list[EngineCoreEvent] = field(default_factory=list)  # since its last output
    # With its first token, if the request asked: per prompt token after the
    # first, token ids and their logprobs, the prompt's token first.
    prompt_logprobs: list[tuple[list[int], list[float]]] | None = None


@dataclass
class RequestOutput:
    """A request's state after a step (``finished`` False) or at its end.

    ``token_ids`` and ``text`` are cumulative. ``finish_reason`` is a
    FinishReason once the request ends, and None while it runs.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None = None
    logprobs: list[dict[int, float]] | None = None
    # With prompt_logprobs: per prompt token, {token id: logprob} for the prompt's
    # token and the top ones, given the tokens before it; None for the first (vLLM's).
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at admission
    times: RequestTimes | None = None  # arrival, first token, finish
    events: list[EngineCoreEvent] = field(default_factory=list)  # queued, scheduled, preempted
