"""The KV-cache coordinator (engine/kv/coordinator.py), DeepSeek-V4's, under any
sequence of operations, as test_block_manager_property.py drives the plain one.

A state machine drives one KVCacheCoordinator the way the scheduler does: new
requests and forks, prompt chunks and decode tokens, the window giving token
blocks back (sinks 0, as V4 runs), drafts allocated and rolled back
(free_tail), partial publishing, preemption and resumption, finishing. It keeps a
model of what each block holds: a token block's keys and values, and a span
block's state (V4's compressed rows), each computed from a token prefix. It runs
with one span group, as V4 has, and with a second whose span need not divide the
first's. After every operation: reference counts are the holders of every table,
free plus held blocks are all blocks, a sequence holds one block of each span
group per span it has allocated, the token blocks it still holds are the ones
its window reads, a published name (token or span) names a block computed for
exactly that chain, a prefix hit hands over whole spans of every group and the
window blocks of the chain it was asked for,
nobody writes into a block someone else holds, and freeing everything at the
end returns every block."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import initialize, invariant, precondition, rule

from engine.config.cache_groups import KVCacheGroups, SpanGroup
from engine.kv.coordinator import KVCacheCoordinator
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


def table(s: Sequence, group: int) -> list[int]:
    """The sequence's table of span group ``group``, if it has one yet."""
    return s.block_tables[group] if len(s.block_tables) > group else []


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
        per_second_span=st.sampled_from([0, 1, 3]),  # 0: one span group, as V4 has
        window_blocks=st.integers(1, 4),
        num_blocks=st.integers(6, 30),
        prefixes=st.lists(st.lists(TOKENS, min_size=1, max_size=16), min_size=1, max_size=3),
    )
    def start(
        self, block_size, per_span, per_second_span, window_blocks, num_blocks, prefixes
    ) -> None:
        self.bs = block_size
        # Span group g's span is spans[g - 1]; a second group's need not divide the first's.
        self.spans = [block_size * k for k in (per_span, per_second_span) if k]
        self.window = window_blocks * block_size
        spans = tuple(SpanGroup(span) for span in self.spans)
        self.groups = KVCacheGroups(block_size, self.window, spans)
        self.bm = KVCacheCoordinator(num_blocks, self.groups, True, None)
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
        assert n % self.groups.hit_unit() == 0, "a hit covers whole spans of every group"
        for i, block_id in enumerate(hits):
            if block_id != HOLE:  # a window block of the asked-for chain
                assert self.written.get(block_id) == tuple(s.token_ids[: (i + 1) * self.bs])
        first_read = max(0, n - self.window) // self.bs
        assert all(b == HOLE for b in hits[:first_read]) and HOLE not in hits[first_read:]
        if not self.bm.can_admit(hits, n + 1):
            return False
        self.bm.take_cached(s, hits)
        for g, span in enumerate(self.spans, 1):  # the span blocks of the hit's spans
            assert len(table(s, g)) == (n // span if hits else 0)
            for j, block_id in enumerate(table(s, g)):
                assert self.written.get(block_id) == tuple(s.token_ids[: (j + 1) * span])
        assert self.bm.allocate(s, n + 1)  # can_admit said so
        assert s.num_computed_tokens == n
        self.running.append(s)
        self.running.sort(key=lambda q: q.seq_id)
        return True

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
            for g, span in enumerate(self.spans, 1):
                self.write(table(s, g)[p // span], prefix)
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
            nc = s.num_computed_tokens  # every table back to what the computed tokens need
            assert len(s.block_table) == cdiv(nc, self.bs)
            assert [len(table(s, g)) for g in range(1, len(self.spans) + 1)] == [
                cdiv(nc, span) for span in self.spans
            ]
            s.token_ids.append(token)

    # ------------------------------------------------------------ invariants

    @invariant()
    def reference_counts_are_the_holders(self) -> None:
        holders: dict[int, int] = {}
        for s in self.running:
            held = [b for t in s.block_tables for b in t if b != HOLE]
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
            nc = s.num_computed_tokens
            for g, span in enumerate(self.spans, 1):
                rows = table(s, g)
                assert len(rows) == cdiv(len(s.block_table) * self.bs, span) or (
                    len(rows) == cdiv(nc + 1, span)
                ), (g, len(rows), len(s.block_table), nc)
                for j in range(cdiv(nc, span)):  # every computed span's block
                    expected = tuple(s.token_ids[: min(nc, (j + 1) * span)])
                    assert self.written.get(rows[j]) == expected
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
            if any(
                len(chain) % span == 0
                and name == self.bm.span_name(chain_name(self.bm.root, chain, self.bs), g)
                for g, span in enumerate(self.spans, 1)
            ):
                continue  # a span block: a whole span's state
            assert len(chain) % self.bs == 0 and name == chain_name(self.bm.root, chain, self.bs)
            assert self.bm.blocks[block_id].token_ids == chain[-self.bs :]


GroupedBlocksMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=50, deadline=None, derandomize=True
)
TestGroupedBlocksUnderAnyOperations = GroupedBlocksMachine.TestCase
