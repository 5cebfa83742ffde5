"""Demo: quality against memory, for every cache the engine offers.

The table `deepinfer bench --kv-quality` prints (engine/tools/kv_quality.py),
on both tiny models and on a random DeepSeek-V3.2 model, whose first row keeps
every token (dense) and whose second keeps 32 a query (DSA). For each cache:

- ppl: the perplexity of held-out text (the first HELDOUT tokens of the book's
  Chapter 1 as it stood when the tiny models were trained, which they never saw),
  scored with prompt_logprobs in windows of 256 tokens, the window cache's in
  one-block chunks so that blocks really go back between them;
- gap: the perplexity minus the first row's, as an interval holding LEVEL of a
  bootstrap that resamples the windows (the same draws for every row, so the
  text's own spread cancels); an interval that holds 0 finds no difference;
- free: the share of GEN greedy tokens that equal the first row's reply;
- forced: the first row's replies fed back through the cache, the share of
  their positions where the cache's most likely token is the reply's own;
- bytes: the pool's bytes per token; peak: the most blocks one request held.

On one torch thread. Perplexities are rounded to FIGURES significant figures
(a random model's, near the vocabulary's size, to none after the point), gaps
to one place more than a perplexity with places (a whole one's whole), shares to
three places. `deepinfer bench --kv-quality`
scores the whole file and 256 tokens.
"""

from __future__ import annotations

import re

from engine.tools.kv_quality import LEVEL, QualityRow, Sizes, measure

FIGURES = 4  # perplexity's significant figures, printed and recorded
HELDOUT, GEN = 4864, 128  # 19 scored windows of 256 tokens; greedy tokens per reply


def key_of(model: str, cache: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", f"{model} {cache}".lower()).strip("_")


def verdict(low: float, high: float) -> str:
    """Where a rounded gap interval lies."""
    return "lies above zero" if low > 0 else "lies below zero" if high < 0 else "holds zero"


def row_results(key: str, r: QualityRow) -> dict:
    places = max(0, FIGURES - len(str(int(r.perplexity))))
    gap_places = places + 1 if places else 0
    low, high = (round(x, gap_places) + 0.0 for x in r.gap_interval)  # + 0.0: no -0.0
    ppl_low, ppl_high = (round(x, places) for x in r.perplexity_interval)
    if not places:
        low, high, ppl_low, ppl_high = int(low), int(high), int(ppl_low), int(ppl_high)
    gap = f"{low:.{gap_places}f}..{high:.{gap_places}f}"
    print(f" {r.cache:<12}{r.perplexity:>6.{places}f}{gap:>13}{r.agreement:>6.3f}"
          f"{r.forced_agreement:>7.3f}{r.bytes_per_token:>6.0f}{r.peak_blocks:>5}")  # fmt: skip
    return {
        f"ppl_{key}": round(r.perplexity, places) if places else round(r.perplexity),
        f"ppl_low_{key}": ppl_low,
        f"ppl_high_{key}": ppl_high,
        f"gap_low_{key}": low,
        f"gap_high_{key}": high,
        f"gap_says_{key}": verdict(low, high),
        f"agree_{key}": round(r.agreement, 3),
        f"forced_{key}": round(r.forced_agreement, 3),
        f"bytes_{key}": round(r.bytes_per_token),
        f"blocks_{key}": r.peak_blocks,
    }


def main() -> dict:
    rows = measure(sizes=Sizes(heldout_tokens=HELDOUT, gen_tokens=GEN))
    results: dict = {"heldout_tokens": HELDOUT, "gen_tokens": GEN}
    for model in dict.fromkeys(r.model for r in rows):
        print(model)
        print(f" {'cache':<12}{'ppl':>6}{f'gap {LEVEL:.0%}':>13}{'free':>6}{'forced':>7}"
              f"{'bytes':>6}{'peak':>5}")  # fmt: skip
        table = [r for r in rows if r.model == model]
        for r in table:
            results |= row_results(key_of(r.model, r.cache), r)
        first = key_of(model, table[0].cache)
        low, high = results[f"ppl_low_{first}"], results[f"ppl_high_{first}"]
        print(f" {table[0].cache}'s perplexity, {LEVEL:.0%}: {low}..{high}")
    return results


if __name__ == "__main__":
    main()
