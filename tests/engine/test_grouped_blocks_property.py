"""DeepSeek-V4's grouped block manager (engine/kv/grouped_blocks.py) under any
sequence of operations, as test_block_manager_property.py drives the plain one.

A state machine drives one GroupedBlockManager the way the scheduler does: new
requests and forks, prompt chunks and decode tokens, the window giving token
blocks back (sinks 0, as V4 runs), drafts allocated and rolled back
(free_tail), partial publishing, preemption and resumption, finishing. It keeps a
model of what each block holds: a token block's keys and values, and a row
block's compressed rows, each computed from a token prefix. After every
operation: reference counts are the holders of both tables, free plus held
blocks are all blocks, a sequence holds one row block per row span it has
allocated, the token blocks it still holds are the ones its window reads, a
published name (token or row) names a block computed for exactly that chain, a
prefix hit hands over rows and window blocks of the chain it was asked for,
nobody writes into a block someone else holds, and freeing everything at the
end returns every block."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, precondition, rule

from engine.kv.grouped_blocks import GroupedBlockManager
from engine.kv.hashing import chain_hash
from engine.scheduler_output import HOLE
from engine.sequence import Sequence
from engine.utils import cdiv
from tests.engine.test_block_manager_property import TOKENS, BlockManagerMachine


def chain_name(root: bytes, tokens: tuple[int, ...], bs: int) -> bytes:
    parent = root
    for i in range(0, len(tokens), bs):
        parent = chain_hash(parent, tokens[i : i + bs])
    return parent


class GroupedBlocksMachine(BlockManagerMachine):
    """The plain machine's rules (new requests, forks, publishing part, sampling,
    preempting, resuming, finishing) on a grouped block manager, with its own
    admission, compute step, draft rollback and checks, each replacing the plain
    one of the same name. ``written[block]``: the token prefix the block's last
    written entry was computed from; a row block's rows depend on every token of
    its span so far."""

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        per_span=st.sampled_from([1, 2, 4]),
        window_blocks=st.integers(1, 4),
        num_blocks=st.integers(6, 30),
        prefixes=st.lists(st.lists(TOKENS, min_size=1, max_size=16), min_size=1, max_size=3),
    )
    def start(self, block_size, per_span, window_blocks, num_blocks, prefixes) -> None:
        self.bs, self.span = block_size, block_size * per_span
        self.window = window_blocks * block_size
        self.bm = GroupedBlockManager(num_blocks, block_size, True, None, self.span, self.window)
        self.total, self.prefixes = num_blocks, prefixes
        self.running: list[Sequence] = []  # arrival order, as the scheduler keeps them
        self.waiting: list[Sequence] = []
        self.written: dict[int, tuple[int, ...]] = {}
        self.ids = 0

    # ------------------------------------------------------------ helpers

    def try_admit(self, s: Sequence) -> bool:
        hits = self.bm.match_prefix(s.token_ids)
        assert len(hits) * self.bs < s.num_tokens  # the last token is always computed
        n = len(hits) * self.bs
        assert n % self.span == 0, "a hit covers whole row spans"
        for i, block_id in enumerate(hits):
            if block_id != HOLE:  # a window block of the asked-for chain
                assert self.written.get(block_id) == tuple(s.token_ids[: (i + 1) * self.bs])
        first_read = max(0, n - self.window) // self.bs
        assert all(b == HOLE for b in hits[:first_read]) and HOLE not in hits[first_read:]
        if not self.bm.can_admit(hits, n + 1):
            return False
        self.bm.take_cached(s, hits)
        for j, row in enumerate(s.row_table):  # the rows of the hit's spans
            assert self.written.get(row) == tuple(s.token_ids[: (j + 1) * self.span])
        assert self.bm.allocate(s, n + 1)  # can_admit said so
        assert s.num_computed_tokens == n
        self.running.append(s)
        self.running.sort(key=lambda q: q.seq_id)
        return True

    def preempt(self, s: Sequence) -> None:
        self.running.remove(s)
        self.bm.free(s)
        assert s.block_table == [] and s.row_table == [] and s.num_computed_tokens == 0
        self.waiting.append(s)

    def make_room(self, s: Sequence, tokens: int) -> bool:
        """Allocate for ``tokens``, preempting the newest while it does not fit;
        False if ``s`` itself was preempted."""
        while not self.bm.allocate(s, tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is s:
                return False
        return True

    def write(self, block_id: int, prefix: tuple[int, ...]) -> None:
        assert self.bm.blocks[block_id].ref_count == 1, "writing into a block another holds"
        self.written[block_id] = prefix

    # ------------------------------------------------------------ rules

    @precondition(lambda self: any(s.num_computed_tokens < s.num_tokens for s in self.running))
    @rule(which=st.integers(0, 99), n=st.integers(1, 9))
    def compute(self, which: int, n: int) -> None:
        """A step runs ``n`` more tokens: their token blocks and the rows of their
        spans are written, the window slides, and what is whole is published."""
        todo = [s for s in self.running if s.num_computed_tokens < s.num_tokens]
        s = todo[which % len(todo)]
        n = min(n, s.num_tokens - s.num_computed_tokens)
        start = s.num_computed_tokens
        if not self.make_room(s, start + n):
            return
        for p in range(start, start + n):
            prefix = tuple(s.token_ids[: p + 1])
            self.write(s.block_table[p // self.bs], prefix)
            self.write(s.row_table[p // self.span], prefix)
        s.num_computed_tokens += n
        self.bm.cache_full_blocks(s)
        self.bm.free_outside_window(s, 0, self.window)

    @precondition(lambda self: any(s.num_computed_tokens == s.num_tokens for s in self.running))
    @rule(which=st.integers(0, 99), drafts=st.integers(1, 5), token=TOKENS)
    def verify_drafts(self, which: int, drafts: int, token: int) -> None:
        """A decode step with ``drafts`` drafts: room for them all, then every draft
        rejected (free_tail gives back what lies past the computed tokens)."""
        done = [s for s in self.running if s.num_computed_tokens == s.num_tokens]
        s = done[which % len(done)]
        if self.make_room(s, s.num_tokens + drafts):
            self.bm.free_tail(s, s.num_computed_tokens)
            s.token_ids.append(token)

    # ------------------------------------------------------------ invariants

    @invariant()
    def reference_counts_are_the_holders(self) -> None:
        holders: dict[int, int] = {}
        for s in self.running:
            held = [b for b in s.block_table if b != HOLE] + s.row_table
            assert len(set(held)) == len(held)
            for block_id in held:
                holders[block_id] = holders.get(block_id, 0) + 1
        for block in self.bm.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)
            assert (block.block_id in self.bm.free_blocks) == (block.ref_count == 0)
        assert self.bm.num_free_blocks + len(holders) == self.total

    @invariant()
    def every_sequence_reads_its_own_chain(self) -> None:
        for s in self.running:
            assert len(s.row_table) == cdiv(len(s.block_table) * self.bs, self.span) or (
                len(s.row_table) == cdiv(s.num_computed_tokens + 1, self.span)
            ), (len(s.row_table), len(s.block_table), s.num_computed_tokens)
            nc = s.num_computed_tokens
            for j in range(cdiv(nc, self.span)):  # every computed span's rows
                expected = tuple(s.token_ids[: min(nc, (j + 1) * self.span)])
                assert self.written.get(s.row_table[j]) == expected
            first_read = max(0, nc - self.window) // self.bs  # the window's first block
            for i in range(first_read, cdiv(nc, self.bs)):
                assert s.block_table[i] != HOLE, "a block the window reads was given back"
                expected = tuple(s.token_ids[: min(nc, (i + 1) * self.bs)])
                assert self.written.get(s.block_table[i]) == expected

    @invariant()
    def published_hashes_name_what_their_blocks_hold(self) -> None:
        for name, block_id in self.bm.cached_blocks.items():
            chain = self.written.get(block_id)
            assert self.bm.blocks[block_id].hash == name and chain is not None
            if len(chain) % self.span == 0 and name == self.bm.row_name(
                chain_name(self.bm.root, chain, self.bs)
            ):
                continue  # a row block: the rows of a whole span
            assert len(chain) % self.bs == 0 and name == chain_name(self.bm.root, chain, self.bs)
            assert self.bm.blocks[block_id].token_ids == chain[-self.bs :]


GroupedBlocksMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, derandomize=True
)
TestGroupedBlocksUnderAnyOperations = GroupedBlocksMachine.TestCase
