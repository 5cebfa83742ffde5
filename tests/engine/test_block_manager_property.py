"""The block manager under pressure and under any sequence of operations.

Eviction keeps what a prefix hit can use: a hash chain is only useful from its
head, so a freed sequence's blocks go back tail first and pressure takes a cached
prefix's last blocks before its first ones, in the block manager alone and as
the engine reports cached tokens.

Then a state machine drives one block manager the way the scheduler does (new
requests, forks of running ones sharing their prefix, prompt chunks, decode
tokens, partial publishing, preemption and resumption, finishing), while it
keeps a model of what every block's keys and values were computed from. After
every operation: reference counts are the holders, free plus held blocks are
all blocks, a published hash names a block computed for exactly that chain,
nobody writes into a block someone else holds, every hit matches the chain it
was asked for, and at the end freeing everything returns every block."""

from __future__ import annotations

from pathlib import Path

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine import LLM, SamplingParams
from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_hash
from engine.sequence import Sequence
from engine.utils import cdiv
from tests.engine.conftest import random_prompts
from tests.engine.test_block_manager import admit


def test_eviction_takes_a_freed_prefix_from_its_tail() -> None:
    """Bug guarded: freeing a sequence's blocks head first. A cached 8-block prefix
    is freed; another request then needs 3 of its blocks. Asked for again, the
    prefix still hits its first 5 blocks, the very blocks it was computed in."""
    bs, n = 4, 16
    bm = BlockManager(num_blocks=n, block_size=bs)
    prefix = list(range(100, 100 + 8 * bs))
    a = Sequence("a", prefix + [1], SamplingParams())
    assert admit(bm, a) == []
    a.num_computed_tokens = a.num_tokens
    bm.cache_full_blocks(a)
    chain = a.block_table[:8]
    bm.free(a)
    assert bm.match_prefix(prefix + [2]) == chain  # all 8 cached while nothing needs them
    unhashed = n - 8
    b = Sequence("b", [7] * ((unhashed + 3) * bs), SamplingParams())
    assert admit(bm, b) == []  # takes every unhashed block and 3 cached ones
    assert bm.match_prefix(prefix + [2]) == chain[:5]


def test_the_engine_still_hits_a_prefix_head_after_pressure(qwen3: tuple[Path, object]) -> None:
    """Bug guarded: freeing a sequence's blocks head first, through the engine: a
    prompt of 8 full blocks runs, a longer unrelated one evicts 3 of its blocks,
    and the first prompt sent again is told 5 blocks of it were cached."""
    bs, n = 4, 16
    llm = LLM(qwen3[0], dtype="float32", block_size=bs, num_kv_blocks=n, max_model_len=n * bs)
    params = SamplingParams(temperature=0, max_tokens=1)
    prompt, other = random_prompts(2, seed=9, low=60, high=61)
    prompt, other = prompt[: 8 * bs + 1], [3] + other[: (n - 8 + 3) * bs - 1]
    assert llm.generate([prompt], params, use_tqdm=False)[0].num_cached_tokens == 0
    assert llm.generate([other], params, use_tqdm=False)[0].num_cached_tokens == 0
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == (8 - 3) * bs


TOKENS = st.integers(0, 3)  # a tiny alphabet: prefixes collide, twins get computed


class BlockManagerMachine(RuleBasedStateMachine):
    """One block manager, the sequences that hold its blocks, and a model of the cache:
    ``written[block]`` is the token prefix its last written slot's keys and values
    were computed from (attention makes each slot depend on every token before it)."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 20),
        prefixes=st.lists(st.lists(TOKENS, min_size=1, max_size=10), min_size=1, max_size=3),
    )
    def start(self, block_size: int, num_blocks: int, prefixes: list[list[int]]) -> None:
        self.bm = BlockManager(num_blocks, block_size)
        self.total = num_blocks
        self.prefixes = prefixes
        self.running: list[Sequence] = []  # arrival order, as the scheduler keeps them
        self.waiting: list[Sequence] = []  # preempted: tokens kept, no blocks
        self.written: dict[int, tuple[int, ...]] = {}
        self.ids = 0

    # ------------------------------------------------------------ helpers

    def new_seq(self, tokens: list[int]) -> Sequence:
        self.ids += 1
        return Sequence(f"s{self.ids}", tokens, SamplingParams())

    def try_admit(self, s: Sequence) -> bool:
        bs = self.bm.block_size
        hits = self.bm.match_prefix(s.token_ids)
        assert len(hits) * bs < s.num_tokens  # the last token is always computed
        for i, block_id in enumerate(hits):  # a hit is the asked-for chain, from its head
            assert self.written.get(block_id) == tuple(s.token_ids[: (i + 1) * bs])
        if not self.bm.can_admit(hits, len(hits) * bs + 1):
            return False
        self.bm.take_cached(s, hits)
        assert self.bm.allocate(s, len(hits) * bs + 1)  # can_admit said so
        assert s.num_computed_tokens == len(hits) * bs
        self.running.append(s)
        self.running.sort(key=lambda q: q.seq_id)
        return True

    def preempt(self, s: Sequence) -> None:
        self.running.remove(s)
        self.bm.free(s)
        assert s.block_tables == [[]] and s.num_computed_tokens == 0  # every table emptied
        self.waiting.append(s)

    # ------------------------------------------------------------ rules

    @rule(which=st.integers(0, 2), suffix=st.lists(TOKENS, min_size=1, max_size=6))
    def new_request(self, which: int, suffix: list[int]) -> None:
        self.try_admit(self.new_seq(self.prefixes[which % len(self.prefixes)] + suffix))

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 99))
    def fork(self, which: int) -> None:
        """Another choice of a running request's prompt (n > 1): its own sequence,
        sharing whatever the first has published."""
        parent = self.running[which % len(self.running)]
        self.try_admit(self.new_seq(parent.token_ids))

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.running))
    @rule(which=st.integers(0, 99), n=st.integers(1, 9))
    def compute(self, which: int, n: int) -> None:
        """A step runs ``n`` more of a sequence's tokens: find their slots, preempting
        the newest sequences if the cache is full, write their keys and values, publish."""
        todo = [s for s in self.running if s.num_computed_tokens < s.num_tokens]
        s = todo[which % len(todo)]
        n = min(n, s.num_tokens - s.num_computed_tokens)
        start = s.num_computed_tokens
        while not self.bm.allocate(s, start + n):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is s:
                return
        bs = self.bm.block_size
        for p in range(start, start + n):
            block = self.bm.blocks[s.block_table[p // bs]]
            assert block.ref_count == 1, "writing into a block another sequence holds"
            self.written[block.block_id] = tuple(s.token_ids[: p + 1])
        s.num_computed_tokens += n
        self.bm.cache_full_blocks(s)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 99), fraction=st.floats(0, 1))
    def publish_part(self, which: int, fraction: float) -> None:
        """Publish only some computed blocks (the scheduler's prompt-only publishing)."""
        s = self.running[which % len(self.running)]
        self.bm.cache_full_blocks(s, int(s.num_computed_tokens * fraction))

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.running))
    @rule(which=st.integers(0, 99), token=TOKENS)
    def sample(self, which: int, token: int) -> None:
        """A sequence whose tokens are all computed samples its next one."""
        done = [s for s in self.running if s.num_computed_tokens == s.num_tokens]
        done[which % len(done)].token_ids.append(token)

    @precondition(lambda self: self.running)
    @rule(which=st.integers(0, 99))
    def preempt_one(self, which: int) -> None:
        self.preempt(self.running[which % len(self.running)])

    @precondition(lambda self: self.waiting)
    @rule(which=st.integers(0, 99))
    def resume(self, which: int) -> None:
        s = self.waiting[which % len(self.waiting)]
        if self.try_admit(s):
            self.waiting.remove(s)

    @precondition(lambda self: self.running or self.waiting)
    @rule(which=st.integers(0, 99))
    def finish(self, which: int) -> None:
        everyone = self.running + self.waiting
        s = everyone[which % len(everyone)]
        if s in self.running:
            self.running.remove(s)
            self.bm.free(s)
        else:
            self.waiting.remove(s)

    # ------------------------------------------------------------ invariants

    @invariant()
    def reference_counts_are_the_holders(self) -> None:
        holders: dict[int, int] = {}
        for s in self.running:
            assert len(set(s.block_table)) == len(s.block_table)
            for block_id in s.block_table:
                holders[block_id] = holders.get(block_id, 0) + 1
        for s in self.waiting:
            assert s.block_table == []
        for block in self.bm.blocks:
            assert block.ref_count >= 0
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.block_id in self.bm.free_blocks) == (block.ref_count == 0)
        assert self.bm.num_free_blocks + len(holders) == self.total

    @invariant()
    def published_hashes_name_what_their_blocks_hold(self) -> None:
        bs = self.bm.block_size
        for h, block_id in self.bm.cached_blocks.items():
            block = self.bm.blocks[block_id]
            chain = self.written.get(block_id)
            assert block.hash == h and chain is not None and len(chain) % bs == 0
            assert block.token_ids == chain[-bs:]
            parent = self.bm.root
            for i in range(0, len(chain), bs):
                parent = chain_hash(parent, chain[i : i + bs])
            assert parent == h
        hashed = [b.block_id for b in self.bm.blocks if b.hash is not None]
        assert sorted(hashed) == sorted(self.bm.cached_blocks.values())

    @invariant()
    def every_sequence_reads_its_own_chain(self) -> None:
        bs = self.bm.block_size
        for s in self.running:
            nc = s.num_computed_tokens
            assert len(s.block_table) >= cdiv(nc, bs)
            for i in range(cdiv(nc, bs)):
                expected = tuple(s.token_ids[: min(nc, (i + 1) * bs)])
                assert self.written.get(s.block_table[i]) == expected
            assert len(s.block_hashes) <= nc // bs
            parent = self.bm.root
            for i, h in enumerate(s.block_hashes):
                parent = chain_hash(parent, s.token_ids[i * bs : (i + 1) * bs])
                assert h == parent

    def teardown(self) -> None:
        for s in list(self.running):
            self.running.remove(s)
            self.bm.free(s)
        assert self.bm.num_free_blocks == self.total
        assert all(block.ref_count == 0 for block in self.bm.blocks)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, derandomize=True
)
TestBlockManagerUnderAnyOperations = BlockManagerMachine.TestCase
