"""Experiment 7: reference counts and copy-on-write over a fork-and-free trace.

A toy pool of KV blocks, each holding BLOCK tokens, shared between sequences.
Forking a sequence (parallel sampling, or a beam that splits) copies only its
block table and adds one reference to every block in it. Appending a token to
a block that another sequence also references first copies that block (copy
on write), so no sequence ever sees another's tokens. Freeing a sequence drops
its references; a block returns to the free list only when its count reaches 0.

After every operation an invariant check recounts the references from the live
block tables and asserts they match the stored counts, and that no block on the
free list is still referenced.
"""

from __future__ import annotations

import random
from collections import Counter

SEED = 0
BLOCK = 4
POOL = 32
PROMPT = 10
SAMPLES = 4  # parallel sampling: s0 and its forks s1, s2, s3
RANDOM_OPS = 16


class BlockPool:
    def __init__(self, size: int) -> None:
        self.refs = [0] * size
        self.tokens: list[list[int]] = [[] for _ in range(size)]
        self.free = list(range(size))
        self.tables: dict[str, list[int]] = {}
        self.copies = self.checks = 0

    def allocate(self) -> int:
        block = self.free.pop(0)
        assert self.refs[block] == 0
        self.refs[block], self.tokens[block] = 1, []
        return block

    def release(self, block: int) -> None:
        assert self.refs[block] > 0, f"b{block} released with no reference"
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free.append(block)

    def fork(self, parent: str, child: str) -> str:
        self.tables[child] = list(self.tables[parent])
        for block in self.tables[child]:
            self.refs[block] += 1
        return f"from {parent}, {len(self.tables[child])} blocks"

    def append(self, seq: str, token: int) -> str:
        table = self.tables.setdefault(seq, [])
        if not table or len(self.tokens[table[-1]]) == BLOCK:
            table.append(self.allocate())
            note = f"new b{table[-1]}"
        elif self.refs[table[-1]] > 1:
            old, new = table[-1], self.allocate()
            self.tokens[new] = list(self.tokens[old])
            self.release(old)
            table[-1] = new
            self.copies += 1
            note = f"copy b{old}->b{new}"
        else:
            note = f"write b{table[-1]}"
        assert self.refs[table[-1]] == 1, "writing into a shared block"
        self.tokens[table[-1]].append(token)
        return note

    def free_seq(self, seq: str) -> list[int]:
        """Drop the sequence's references; return its blocks, now with their new counts."""
        table = self.tables.pop(seq)
        for block in table:
            self.release(block)
        return table

    def check(self) -> None:
        """Recount references from the live tables; compare with the stored counts."""
        counted = Counter(b for table in self.tables.values() for b in table)
        for block, refs in enumerate(self.refs):
            assert refs == counted[block], f"b{block}: stored {refs}, counted {counted[block]}"
            assert (block in self.free) == (refs == 0), f"b{block} free while referenced"
        self.checks += 1


def run(seed: int = SEED) -> tuple[BlockPool, dict]:
    rng = random.Random(seed)
    pool = BlockPool(POOL)

    def step(op: str, seq: str, note: str, blocks: list[int] | None = None) -> None:
        pool.check()
        refs = " ".join(f"b{b}:{pool.refs[b]}" for b in blocks or pool.tables[seq])
        print(f"{op:<7} {seq:<4} {note:<18} {refs}")

    def free(seq: str) -> None:
        blocks = pool.free_seq(seq)
        freed = [f"b{b}" for b in blocks if pool.refs[b] == 0]
        step("free", seq, f"frees {','.join(freed) or 'none'}", blocks)

    print(f"-- {SAMPLES} samples of one prompt, one token each")
    for _ in range(PROMPT):
        pool.append("s0", rng.randrange(100))
    step("prompt", "s0", f"{PROMPT} tokens")
    samples = [f"s{i}" for i in range(SAMPLES)]
    for child in samples[1:]:  # parallel sampling: SAMPLES samples of one prompt
        step("fork", child, pool.fork("s0", child))
    for seq in samples:
        step("append", seq, pool.append(seq, rng.randrange(100)))
    first_copies = pool.copies  # made by the first append of each sample
    names = SAMPLES
    print(f"-- {RANDOM_OPS} random forks, appends and frees")
    for _ in range(RANDOM_OPS):
        live = sorted(pool.tables)
        seq, roll = rng.choice(live), rng.random()
        if roll < 0.15:
            child, names = f"s{names}", names + 1
            step("fork", child, pool.fork(seq, child))
        elif roll < 0.3 and len(live) > 1:
            free(seq)
        else:
            step("append", seq, pool.append(seq, rng.randrange(100)))
    last = sorted(pool.tables)
    print("-- the end: every sequence left is freed")
    for seq in last:
        free(seq)
    return pool, {"copies_in_first_appends": first_copies, "last_freed": last[-1]}


def main() -> dict:
    print(f"pool of {POOL} blocks of {BLOCK} tokens;")
    print("refs shown as block:count for the sequence's blocks")
    print()
    pool, results = run()
    print()
    print(f"copies made by copy-on-write: {pool.copies}")
    print(f"invariant checks passed: {pool.checks}")
    print("  (stored refs = live references; free = unreferenced)")
    print(f"blocks free at the end: {len(pool.free)} of {POOL}")
    return {
        "pool": POOL,
        "block": BLOCK,
        "prompt_tokens": PROMPT,
        "prompt_full_blocks": PROMPT // BLOCK,
        "samples": SAMPLES,
        "forks": SAMPLES - 1,
        "copies": pool.copies,
        "checks": pool.checks,
        "free_at_end": len(pool.free),
        **results,
    }


if __name__ == "__main__":
    main()
