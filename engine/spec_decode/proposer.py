"""The interface of a draft proposer. Every proposer runs in the model runner,
after a step's sampling (runner/drafting.py), and guesses the tokens after
each request's newest one; the guesses go back to the scheduler with the step's
tokens, which schedules them at the request's next step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from engine.sequence import RequestTokens

if TYPE_CHECKING:
    import torch

    from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Draft:
    """A proposer's guess of the tokens after a sequence's newest one.

    ``probs`` is q, row j the distribution ``token_ids[j]`` was drawn from
    ([len(token_ids), vocab], on the model's device); None for a deterministic
    proposer (n-gram), whose q is one-hot at each draft. The rejection sampler
    needs q to keep a sampled request's distribution the target's own.
    ``confidence[j]`` is the proposer's probability for ``token_ids[j]``, for
    a verify-length schedule to spend (verify_length.py); None if it has none."""

    token_ids: list[int]
    probs: torch.Tensor | None = None
    confidence: tuple[float, ...] | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    def head(self, n: int) -> Draft:
        """The first ``n`` drafts (and their rows of q)."""
        probs = None if self.probs is None else self.probs[:n]
        confidence = None if self.confidence is None else self.confidence[:n]
        return Draft(self.token_ids[:n], probs, confidence)


NO_DRAFT = Draft([])


@dataclass
class DraftRequest(RequestTokens):
    """A request as a proposer sees it in the model runner: its settings, and
    its prompt and the tokens it has kept so far."""

    request_id: str
    params: SamplingParams
    seed: int
    num_prompt_tokens: int
    token_ids: list[int]


class DraftProposer(Protocol):
    """Guesses of the tokens that follow some requests' newest tokens, for the
    model to check in the same step as the next (speculative decoding)."""

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Draft]:
        """Drafts by request id; a request left out gets none."""
        ...

    def forget(self, req_ids: list[str]) -> None:
        """These requests ended: drop whatever the proposer keeps for them."""
        ...
