"""Experiment 25: a regular expression, its DFA, and a token mask.

A grammar constrains characters; a model chooses tokens, strings of several
characters. The experiment builds the minimal DFA of a number pattern from
Python's own `re` (two prefixes share a state when the same continuations
complete them), then walks every token of a toy vocabulary through it from
every state: a token is allowed where its whole string keeps the DFA alive,
and end-of-sequence where the state accepts.
"""

from __future__ import annotations

import itertools
import re

PATTERN = r"-?(0|[1-9][0-9]*)(\.[0-9]+)?"
ALPHABET = "-.019"  # the characters that matter, with digits stood for by 0, 1, 9
PROBE = 4  # continuations up to this length tell states apart
VOCAB = ["-", "0", "1", "9", ".", "10", "01", "1.", ".9", "-0", "9.9", "..", "<eos>"]
TEXT = "-10.9"


def signature(prefix: str, probes: list[str]) -> tuple[bool, ...]:
    return tuple(re.fullmatch(PATTERN, prefix + s) is not None for s in probes)


def build_dfa() -> tuple[dict[str, str], dict[tuple[str, str], str], set[str]]:
    """States named by their shortest prefix; transitions; accepting states.
    A prefix no continuation can complete is the dead state, left out."""
    probes = ["".join(p) for n in range(PROBE + 1) for p in itertools.product(ALPHABET, repeat=n)]
    states: dict[tuple[bool, ...], str] = {}
    delta: dict[tuple[str, str], str] = {}
    queue = [""]
    states[signature("", probes)] = ""
    while queue:
        prefix = queue.pop(0)
        for ch in ALPHABET:
            sig = signature(prefix + ch, probes)
            if not any(sig):
                continue  # dead
            if sig not in states:
                states[sig] = prefix + ch
                queue.append(prefix + ch)
            delta[prefix, ch] = states[sig]
    accepting = {name for sig, name in states.items() if sig[0]}  # probe "" is first
    return {name: name for name in states.values()}, delta, accepting


def walk(delta: dict, state: str, text: str) -> str | None:
    for ch in text:
        state = delta.get((state, ch))
        if state is None:
            return None
    return state


def main() -> dict:
    states, delta, accepting = build_dfa()
    print(f"pattern {PATTERN}")
    print(f"{len(states)} live states, {len(delta)} transitions")
    print()
    print(f"{'state':<7} allowed tokens")
    walks = 0
    allowed_counts = {}
    for state in states:
        allowed = []
        for token in VOCAB:
            walks += 1
            at_end = token == "<eos>"
            if state in accepting if at_end else walk(delta, state, token) is not None:
                allowed.append(token)
        allowed_counts[state] = len(allowed)
        name = repr(state) if state else "start"
        print(f"{name:<7} {' '.join(allowed)}")
    split_a = ["1", "0"]
    split_b = ["10"]
    same_end = walk(delta, walk(delta, "-", split_a[0]), split_a[1]) == walk(delta, "-", "10")
    print()
    print(f"{len(states)} states x {len(VOCAB)} tokens: {walks} walks")
    print(f"'-' then {split_a} or {split_b}: same state: {same_end}")
    path = walk(delta, "", TEXT)
    print(f"{TEXT!r} ends in {path!r}, accepting: {path in accepting}")
    return {
        "pattern": PATTERN,
        "states": len(states),
        "transitions": len(delta),
        "vocab": len(VOCAB),
        "walks": walks,
        "allowed_at_start": allowed_counts[""],
        "allowed_after_dot": allowed_counts.get("0.", 0),
        "max_allowed": max(allowed_counts.values()),
        "same_end": same_end,
    }


if __name__ == "__main__":
    main()
