"""Demo: quality against memory, for every cache the engine offers.

The table `deepinfer bench --kv-quality` prints (engine/tools/kv_quality.py),
on both tiny models and on a random DeepSeek-V3.2 model: for each cache, the
perplexity of held-out text (the first HELDOUT tokens of the book's Chapter 1 as
it stood when the tiny models were trained, which they never saw), scored with
prompt_logprobs, the window's in one-block chunks so that blocks really go back
between them; the share of GEN greedy tokens that equal the exact cache's, and
the first that differs; the pool's bytes per token; and the most blocks a
request held. On one torch thread, with perplexities rounded to FIGURES significant
figures (a random model's, near the vocabulary's size, to none after the point).
`deepinfer bench --kv-quality` scores the whole file and 256 tokens.
"""

from __future__ import annotations

import re

from engine.tools.kv_quality import Sizes, measure

FIGURES = 4  # perplexity's significant figures, printed and recorded
HELDOUT, GEN = 4864, 128  # 19 scored windows of 256 tokens; greedy tokens per reply


def main() -> dict:
    rows = measure(sizes=Sizes(heldout_tokens=HELDOUT, gen_tokens=GEN))
    results: dict = {"heldout_tokens": HELDOUT, "gen_tokens": GEN}
    model = None
    for r in rows:
        if r.model != model:
            model = r.model
            print(model)
            print(f"  {'cache':<18}{'ppl':>8}{'agree':>7}{'diff':>5}{'bytes':>6}{'blocks':>7}")
        first = "-" if r.first_difference is None else str(r.first_difference)
        places = max(0, FIGURES - len(str(int(r.perplexity))))
        print(f"  {r.cache:<18}{r.perplexity:>8.{places}f}{r.agreement:>7.3f}{first:>5}"
              f"{r.bytes_per_token:>6.0f}{r.peak_blocks:>7}")  # fmt: skip
        key = re.sub(r"[^a-z0-9]+", "_", f"{r.model} {r.cache}".lower()).strip("_")
        results |= {
            f"ppl_{key}": round(r.perplexity, places) if places else round(r.perplexity),
            f"agree_{key}": round(r.agreement, 3),
            f"first_{key}": -1 if r.first_difference is None else r.first_difference,
            f"bytes_{key}": round(r.bytes_per_token),
            f"blocks_{key}": r.peak_blocks,
        }
    return results


if __name__ == "__main__":
    main()
