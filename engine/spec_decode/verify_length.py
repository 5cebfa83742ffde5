"""How many of each request's drafts to verify this step: DSpark's question.

A fixed k verifies every draft a proposer makes. But a draft the proposer was
unsure of is likely rejected, and verifying it still costs the step a token of
compute; in a full batch that token could have been a decode or a prefill
chunk. The confidence schedule (after DeepSeek's DSpark paper, built from its
description) spends verification where it pays:

- each draft's gain is the chance that it and every draft before it are
  accepted, estimated as the product of the proposer's confidences in them;
- drafts are taken best gain first (a request's later drafts never gain more
  than its earlier ones, so each request keeps a prefix of its drafts), while
  the expected output tokens per second of step time still rise, with step
  time read from the engine's measured profile (StepTimeProfile);
- and never more than the step's verify budget in tokens.

A proposer without confidences (n-gram) keeps its drafts as a fixed k would."""

from __future__ import annotations

import json
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path

from engine.spec_decode.proposer import Draft


@dataclass(frozen=True)
class StepTimeProfile:
    """Seconds a forward pass takes for n tokens, at measured token counts
    (increasing), interpolated linearly between them and extended past the last
    along its final slope."""

    tokens: tuple[int, ...]
    seconds: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.tokens) < 2 or len(self.tokens) != len(self.seconds):
            raise ValueError("a step-time profile needs two or more (tokens, seconds) points")
        if any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError("a step-time profile's token counts must increase")

    def time(self, n: int) -> float:
        i = min(max(bisect_left(self.tokens, n), 1), len(self.tokens) - 1)
        (t0, t1), (s0, s1) = self.tokens[i - 1 : i + 1], self.seconds[i - 1 : i + 1]
        return s0 + (s1 - s0) * (n - t0) / (t1 - t0)

    @classmethod
    def load(cls, path: str | Path) -> StepTimeProfile:
        """From JSON: {"tokens": [...], "seconds": [...]}, as save writes it."""
        data = json.loads(Path(path).read_text())
        return cls(tuple(data["tokens"]), tuple(data["seconds"]))

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"tokens": self.tokens, "seconds": self.seconds}))


@dataclass(frozen=True)
class StepShape:
    """A step before its drafts: the tokens it computes (a token per decoding
    request, and any prefill chunks), and the output tokens it is sure of (a
    token per decoding request)."""

    num_tokens: int
    num_outputs: int


def gains(draft: Draft) -> list[float]:
    """The chance that each draft and all before it are accepted, taking the
    proposer's confidence in a draft as its chance of acceptance."""
    out, alive = [], 1.0
    for c in draft.confidence or ():
        alive *= c
        out.append(alive)
    return out


# --8<-- [start:choose_lengths]
def choose_lengths(
    drafts: dict[str, Draft], step: StepShape, budget: int, profile: StepTimeProfile
) -> dict[str, int]:
    """How many drafts each request verifies. A draft is taken, best gain
    first, while the step's expected output tokens per second of step time
    rise, and while the ``budget`` of draft tokens lasts."""
    candidates = sorted(
        ((g, j, req_id) for req_id, d in drafts.items() for j, g in enumerate(gains(d))),
        key=lambda c: (-c[0], c[1]),  # a request's drafts in order among equal gains
    )
    lengths = dict.fromkeys(drafts, 0)
    expected, tokens = float(step.num_outputs), step.num_tokens
    for gain, _, req_id in candidates[:budget]:
        now = expected / profile.time(tokens)
        if (expected + gain) / profile.time(tokens + 1) <= now:
            break  # it no longer pays, nor will any later (smaller) gain
        lengths[req_id] += 1
        expected, tokens = expected + gain, tokens + 1
    return lengths


# --8<-- [end:choose_lengths]


class ConfidenceSchedule:
    """The scheduler's seam: drafts in, each cut to the length it should verify."""

    def __init__(self, budget: int, profile: StepTimeProfile) -> None:
        self.budget, self.profile = budget, profile

    def cut(self, drafts: dict[str, Draft], step: StepShape) -> dict[str, Draft]:
        scored = {r: d for r, d in drafts.items() if d.confidence is not None}
        lengths = choose_lengths(scored, step, self.budget, self.profile)
        return {r: d.head(lengths[r]) if r in lengths else d for r, d in drafts.items()}
