"""Experiment 6: prefix hash chains, and the blocks a shared system prompt saves.

A prefix cache names each full block of BLOCK tokens by a hash of its tokens
together with the hash of the block before it. Two requests therefore give a
block the same name only if everything up to the end of that block is the
same, so a block can be reused without comparing whole prefixes. Only full
blocks are named; a partial last block is never shared.

N requests share one system prompt and then ask different questions. Count the
blocks they need with and without reuse, then change a single early token and
see how far the change travels down the chain.
"""

from __future__ import annotations

import hashlib
import random

SEED = 0
BLOCK = 16
VOCAB = 32000
SYSTEM = 200  # tokens of shared system prompt
N = 8  # requests
QUESTION = (20, 120)  # each request's own tokens after the system prompt: fewest, most
HEX = 4  # hex digits shown of each hash
SHOWN_REQUESTS = 4  # requests whose chains are printed
SHOWN_BLOCKS = range(8, 16)  # the blocks around the end of the system prompt
EDITED = 0  # the request whose tokens are changed, one at a time...
EDITS = (3, 100)  # ...at these positions
EDIT_BLOCKS = range(3, 11)  # the blocks shown before and after each change


def block_hashes(tokens: list[int]) -> list[str]:
    """One hash per full block, each over its parent's hash and its own token ids."""
    hashes, parent = [], b""
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        block = tokens[start : start + BLOCK]
        digest = hashlib.sha256(parent + b",".join(str(t).encode() for t in block)).digest()
        hashes.append(digest.hex())
        parent = digest
    return hashes


def make_requests(seed: int = SEED) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(VOCAB) for _ in range(SYSTEM)]
    return [
        system + [rng.randrange(VOCAB) for _ in range(rng.randint(*QUESTION))] for _ in range(N)
    ]


def show(label: str, hashes: list[str], blocks: range) -> None:
    """The first HEX hex digits of the chosen blocks of a chain ("-" past its end)."""
    cells = [hashes[i][:HEX] if i < len(hashes) else "-" for i in blocks]
    print(f"{label:<10}" + "".join(f"{c:>{HEX + 1}}" for c in cells))


def main() -> dict:
    requests = make_requests()
    chains = [block_hashes(r) for r in requests]
    print(f"{N} requests: a {SYSTEM}-token system prompt, then")
    print(f"  {QUESTION[0]}-{QUESTION[1]} tokens of their own; blocks of {BLOCK}")
    print(f"the system prompt fills {SYSTEM // BLOCK} full blocks")
    print(f"  and {SYSTEM % BLOCK} tokens of the next")
    print()
    print(f"first {HEX} hex digits of each block's hash,")
    print(f"  blocks {SHOWN_BLOCKS[0]} to {SHOWN_BLOCKS[-1]}:")
    print(f"{'block':<10}" + "".join(f"{i:>{HEX + 1}}" for i in SHOWN_BLOCKS))
    for i, chain in enumerate(chains[:SHOWN_REQUESTS]):
        show(f"request {i}", chain, SHOWN_BLOCKS)
    print()
    total = sum(len(c) for c in chains)
    unique = len({h for c in chains for h in c})
    shared = sum(
        all(len(c) > i and c[i] == chains[0][i] for c in chains) for i in range(len(chains[0]))
    )
    print(f"blocks shared by all {N} requests: {shared}")
    print(f"full blocks needed: {total} without reuse, {unique} with it")
    print(f"  saved: {total - unique}")
    results: dict = {}
    for n, position in enumerate(EDITS, 1):
        edited = list(requests[EDITED])
        edited[position] = (edited[position] + 1) % VOCAB
        new = block_hashes(edited)
        changed = [a != b for a, b in zip(chains[EDITED], new)]
        first = changed.index(True)
        print()
        print(f"change token {position} (block {position // BLOCK}) of request {EDITED}:")
        print(f"{'  block':<10}" + "".join(f"{i:>{HEX + 1}}" for i in EDIT_BLOCKS))
        show("  before", chains[EDITED], EDIT_BLOCKS)
        show("  after", new, EDIT_BLOCKS)
        kept = f"the first {first} unchanged" if first else "none unchanged"
        print(f"  blocks {first}-{len(new) - 1} changed ({sum(changed)} of {len(new)}), {kept}")
        results.update(
            {
                f"edit_{n}_token": position,
                f"edit_{n}_block": position // BLOCK,
                f"edit_{n}_first_changed": first,
                f"edit_{n}_last_changed": len(new) - 1,
                f"edit_{n}_changed": sum(changed),
                f"edit_{n}_unchanged": len(new) - sum(changed),
                f"edit_{n}_last_unchanged": first - 1,
            }
        )
    return {
        "requests": N,
        "system_tokens": SYSTEM,
        "block": BLOCK,
        "system_full_blocks": SYSTEM // BLOCK,
        "system_tail_tokens": SYSTEM % BLOCK,
        "system_full_block_tokens": SYSTEM // BLOCK * BLOCK,
        "first_own_block": SYSTEM // BLOCK,
        "shared_blocks": shared,
        "blocks_without_reuse": total,
        "blocks_with_reuse": unique,
        "blocks_saved": total - unique,
        "edited_request_blocks": len(chains[EDITED]),
        **results,
    }


if __name__ == "__main__":
    main()
