"""Demo: a sliding window with attention sinks frees blocks while a request runs.

One greedy request on deepinfer-tiny generates a long reply three times: with the
whole context cached, with a window that keeps the first SINKS tokens and the
last WINDOW tokens (rounded out to whole blocks), and with a window wider than
the whole sequence. The engine is stepped by hand, so that after every step we
can count the blocks the request holds. The demo prints the blocks in use at a
few points of the reply, the blocks the window gave back, the bound the window
promises, and how many of the reply's tokens each windowed run shares with the
full-context one.
"""

from __future__ import annotations

import os

from engine import LLM, SamplingParams
from engine.utils import cdiv

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPT = "The block manager hands out blocks of the paged cache, and a block table maps"
SINKS, WINDOW, BLOCK = 4, 64, 16
WIDE = 4096  # wider than the prompt and the reply together
REPLY = 600
CHECKPOINTS = (150, 300, 450)  # reply tokens at which blocks in use are printed


def run(window: tuple[int, int] | None) -> tuple[list[int], dict[int, int], int, int]:
    """The reply, blocks held at each checkpoint, the most held, and blocks freed."""
    llm = LLM(MODEL, dtype="float32", block_size=BLOCK, num_kv_blocks=64, kv_window=window)
    engine = llm.llm_engine
    engine.add_request(
        "r", PROMPT, SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True)
    )
    held, most, tokens = {}, 0, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.token_ids
        seq = engine.scheduler.running[0] if engine.scheduler.running else None
        in_use = 0 if seq is None else sum(1 for b in seq.block_table if b >= 0)
        most = max(most, in_use)
        if len(tokens) in CHECKPOINTS and seq is not None:
            held.setdefault(len(tokens), in_use)
    return tokens, held, most, engine.stats.window_freed_blocks


def main() -> dict:
    full, full_held, full_most, _ = run(None)
    windowed, held, most, freed = run((SINKS, WINDOW))
    wide, _, _, wide_freed = run((SINKS, WIDE))
    bound = cdiv(SINKS, BLOCK) + cdiv(WINDOW, BLOCK) + 1
    print(f"window: {SINKS} sinks, last {WINDOW} tokens, blocks of {BLOCK}")
    print(f"{'reply tokens':>12} {'full blocks':>12} {'window blocks':>14}")
    for n in CHECKPOINTS:
        print(f"{n:>12} {full_held.get(n, '-'):>12} {held.get(n, '-'):>14}")
    print(f"most blocks held, full: {full_most}")
    print(f"most blocks held, window: {most} (bound {bound})")
    print(f"blocks the window gave back: {freed}")
    same = next((i for i, (a, b) in enumerate(zip(full, windowed)) if a != b), len(full))
    print(f"reply tokens before the first change: {same}")
    print(f"wide window: same reply as full: {'yes' if wide == full else 'NO'}, freed {wide_freed}")
    return {
        "sinks": SINKS,
        "window": WINDOW,
        "block": BLOCK,
        "reply": REPLY,
        "full_most": full_most,
        "window_most": most,
        "bound": bound,
        "freed": freed,
        "first_differs": same,
        "wide_same": wide == full,
        "wide_freed": wide_freed,
    }


if __name__ == "__main__":
    main()
