"""Experiment 5: fragmentation under contiguous reservation and under paged blocks.

A seeded stream of requests, each with a random prompt and a random output
length. Contiguous reservation gives every request one slab of MAX_LEN token
slots up front, because the output length is unknown when the request starts.
Paged allocation hands out fixed blocks of BLOCK tokens as the sequence grows,
so a request holds ceil(length / BLOCK) blocks at its longest.

Waste is the share of reserved slots that never hold a token: over-reservation
(slots a request was given but never reached) plus internal fragmentation (the
unused tail of the last block). The pool holds POOL token slots; how many of
the stream's requests, at their longest, fit in it at once?
"""

from __future__ import annotations

import random

SEED = 0
REQUESTS = 1000
MAX_LEN = 4096  # the most tokens a request may reach: prompt plus output
MIN_PROMPT = MIN_OUTPUT = 1
MAX_PROMPT = MAX_OUTPUT = 2048
BLOCK = 16
POOL = 65536  # token slots: 8 GiB of KV cache at Llama-3.1-8B's 128 KiB per token
SCHEMES = {  # name: block size, None for one contiguous slab of MAX_LEN
    f"contiguous, {MAX_LEN}": None,
    **{f"paged, block {b}": b for b in (BLOCK, 64, 256)},
}
LENGTH_GROUPS = [(1, 512), (513, 1024), (1025, 2048), (2049, 4096)]  # by final length


def request_lengths(seed: int = SEED, n: int = REQUESTS) -> list[int]:
    """Final length (prompt + output) of each request in the stream."""
    rng = random.Random(seed)
    return [
        rng.randint(MIN_PROMPT, MAX_PROMPT) + rng.randint(MIN_OUTPUT, MAX_OUTPUT) for _ in range(n)
    ]


def reserved(length: int, block: int | None) -> int:
    """Token slots held at the request's longest; block None means one contiguous slab."""
    if block is None:
        return MAX_LEN
    return -(-length // block) * block  # ceil to whole blocks


def waste(length: int, block: int | None) -> float:
    return 1 - length / reserved(length, block)


def fit_in_pool(lengths: list[int], block: int | None) -> int:
    """How many requests, taken in stream order at their longest, fit in the pool at once."""
    used = count = 0
    for length in lengths:
        used += reserved(length, block)
        if used > POOL:
            return count
        count += 1
    return count


def main() -> dict:
    lengths = request_lengths()
    used = sum(lengths)
    print(f"{REQUESTS:,} requests, seed {SEED}: prompt {MIN_PROMPT}-{MAX_PROMPT}")
    print(f"  and output {MIN_OUTPUT}-{MAX_OUTPUT} tokens, at most {MAX_LEN:,} in all")
    print(f"mean length {used / REQUESTS:,.0f} tokens; pool of {POOL:,} token slots")
    print()
    print(f"{'scheme':<17} {'reserved':>10} {'used':>10} {'wasted':>7} {'fit':>4}")
    results: dict = {}
    for name, block in SCHEMES.items():
        total = sum(reserved(n, block) for n in lengths)
        fit = fit_in_pool(lengths, block)
        print(f"{name:<17} {total:>10,} {used:>10,} {1 - used / total:>7.1%} {fit:>4}")
        key = "contiguous" if block is None else f"paged_{block}"
        results[f"{key}_waste"] = 1 - used / total
        results[f"{key}_fit"] = fit
    print("(fit: requests, at their longest,")
    print(" that fit in the pool at once)")
    print()
    print(f"waste by request length, contiguous vs paged (block {BLOCK})")
    for i, (low, high) in enumerate(LENGTH_GROUPS):
        group = [n for n in lengths if low <= n <= high]
        slab = sum(waste(n, None) for n in group) / len(group)
        paged = sum(waste(n, BLOCK) for n in group) / len(group)
        print(f"{low:>6}-{high:<5} tokens: {len(group):>4} requests, {slab:>6.1%} vs {paged:>5.2%}")
        results[f"group_{i + 1}_range"] = f"{low:,}-{high:,}"
        results[f"group_{i + 1}_requests"] = len(group)
        results[f"group_{i + 1}_contiguous_waste"] = slab
        results[f"group_{i + 1}_paged_waste"] = paged
    return {
        "seed": SEED,
        "requests": REQUESTS,
        "max_len": MAX_LEN,
        "max_prompt": MAX_PROMPT,
        "max_output": MAX_OUTPUT,
        "pool": POOL,
        "block": BLOCK,
        "largest_block": max(b for b in SCHEMES.values() if b is not None),
        "mean_length": used / REQUESTS,
        "shortest_group_max": LENGTH_GROUPS[0][1],
        "paged_max_empty_slots": BLOCK - 1,
        **results,
    }


if __name__ == "__main__":
    main()
