"""Prompt lookup: guess that a request goes on as it went on before.

Code and prose repeat themselves: a name, once used, is used again, and what
followed it last time often follows it again. The n-gram proposer takes the
longest suffix of the request's own tokens (prompt and output) that occurred
before, from prompt_lookup_max tokens down to prompt_lookup_min, finds its
most recent earlier occurrence, and proposes the up to k tokens that followed
it. It proposes nothing when no such n-gram occurred. No model runs: the drafts
are free, and deterministic (their q is one-hot)."""

from __future__ import annotations

from array import array
from typing import TYPE_CHECKING

from engine.config.speculative import SpeculativeConfig
from engine.spec_decode.proposer import Draft

if TYPE_CHECKING:
    from engine.spec_decode.proposer import DraftRequest

_WIDTH = array("i").itemsize  # bytes per token in the searched buffer


class NgramProposer:
    def __init__(self, k: int, lookup_min: int, lookup_max: int) -> None:
        self.k, self.lookup_min, self.lookup_max = k, lookup_min, lookup_max

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        return cls(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def propose(self, reqs: list[DraftRequest]) -> dict[str, Draft]:
        drafts = {}
        for req in reqs:
            tokens = propose_ngram(req.token_ids, self.lookup_min, self.lookup_max, self.k)
            if tokens:
                drafts[req.request_id] = Draft(tokens)
        return drafts

    def forget(self, req_ids: list[str]) -> None:
        """Nothing to drop: the n-gram proposer keeps nothing between steps."""


def propose_ngram(tokens: list[int], lookup_min: int, lookup_max: int, k: int) -> list[int]:
    """The up to ``k`` tokens that followed the most recent earlier occurrence of
    the longest suffix of ``tokens`` of lookup_min..lookup_max tokens; [] if none.

    The search is bytes.rfind over the tokens packed as 32-bit integers (C speed,
    no per-token Python loop); a hit that does not start on a token boundary is
    skipped."""
    if len(tokens) <= lookup_min:
        return []
    data = array("i", tokens).tobytes()
    last = len(data) - _WIDTH  # an occurrence must end before the newest token
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        start = _rfind_aligned(data, data[-n * _WIDTH :], last)
        if start >= 0:
            after = start // _WIDTH + n
            return tokens[after : after + k]
    return []


def _rfind_aligned(data: bytes, pattern: bytes, end: int) -> int:
    """The highest byte offset, a multiple of the token width, where ``pattern``
    occurs wholly inside data[:end]; -1 if none."""
    pos = data.rfind(pattern, 0, end)
    while pos > 0 and pos % _WIDTH:
        pos = data.rfind(pattern, 0, pos + len(pattern) - 1)
    return pos
