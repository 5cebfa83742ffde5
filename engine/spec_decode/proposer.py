"""The interface between a draft proposer and the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.sequence import Sequence


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


class DraftProposer(Protocol):
    """Guesses of the tokens that follow some decoding sequences, for the model to
    check in the same step as their newest token (speculative decoding)."""

    def propose(self, seqs: list[Sequence]) -> dict[str, Draft]:
        """Drafts by request id; a sequence left out gets none."""
        ...

    def forget(self, req_ids: list[str]) -> None:
        """These requests ended: drop whatever the proposer keeps for them."""
        ...
