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

import hashlib
import random

SEED = 0
BLOCK = 16
VOCAB = 32000
SYSTEM = 200  # tokens of shared system prompt
N = 8  # requests


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
    return [system + [rng.randrange(VOCAB) for _ in range(rng.randint(20, 120))] for _ in range(N)]


def show(label: str, hashes: list[str], first: int, last: int) -> None:
    """The first 6 hex digits of blocks first..last of a chain."""
    cells = [hashes[i][:6] if i < len(hashes) else "-" for i in range(first, last + 1)]
    print(f"{label:<10} " + " ".join(f"{c:>6}" for c in cells))


def main() -> None:
    requests = make_requests()
    chains = [block_hashes(r) for r in requests]
    print(
        f"{N} requests: a {SYSTEM}-token system prompt, then 20-120 tokens each; blocks of {BLOCK}"
    )
    print(
        f"the system prompt fills {SYSTEM // BLOCK} full blocks and {SYSTEM % BLOCK} tokens of the next"
    )
    print()
    print("first 6 hex digits of each block's hash, blocks 8 to 15:")
    print(f"{'block':<10} " + " ".join(f"{i:>6}" for i in range(8, 16)))
    for i, chain in enumerate(chains[:4]):
        show(f"request {i}", chain, 8, 15)
    print()
    total = sum(len(c) for c in chains)
    unique = len({h for c in chains for h in c})
    shared = sum(
        all(len(c) > i and c[i] == chains[0][i] for c in chains) for i in range(len(chains[0]))
    )
    print(f"blocks shared by all {N} requests: {shared}")
    print(f"full blocks needed: {total} without reuse, {unique} with it; {total - unique} saved")
    print()
    for position in (3, 100):
        edited = list(requests[0])
        edited[position] = (edited[position] + 1) % VOCAB
        new = block_hashes(edited)
        changed = [a != b for a, b in zip(chains[0], new)]
        first = changed.index(True)
        print(f"change token {position} (block {position // BLOCK}) of request 0:")
        print(f"{'  block':<10} " + " ".join(f"{i:>6}" for i in range(3, 11)))
        show("  before", chains[0], 3, 10)
        show("  after", new, 3, 10)
        kept = f"blocks 0-{first - 1} unchanged" if first else "no block unchanged"
        print(f"  blocks {first}-{len(new) - 1} changed ({sum(changed)} of {len(new)}), {kept}")


if __name__ == "__main__":
    main()
