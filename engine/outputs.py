"""What each stage of a step hands on: the model runner's sampled tokens, and
what the engine hands back for each request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the front end reads these outputs without importing torch
    import torch


@dataclass
class LogprobsTensors:
    """Per sampled row: column 0 is the chosen token, the rest the top tokens,
    most likely first, as many as the row that asked most wanted."""

    token_ids: torch.Tensor  # [rows, 1 + n] int64
    logprobs: torch.Tensor  # [rows, 1 + n] float32


@dataclass
class RequestOutput:
    """A request's state after a step (``finished`` False) or at its end.

    ``token_ids`` and ``text`` are cumulative. ``finish_reason`` is "stop" (EOS,
    a stop token or a stop string), "length" (max_tokens or the model's context)
    or "abort", and None while the request runs.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
