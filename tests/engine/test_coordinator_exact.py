"""The KV-cache coordinator (engine/kv/coordinator.py) pinned to exact values
(issue 49), on one constructed case: blocks of 2 tokens, a window of 4, row spans
of 4 (two token blocks a span). Which blocks each table takes and in what order
they go back, what is published under which name, what a prefix hit hands over
(HOLEs before the window, whole spans only, never the last token) and the exact
block count at which admission says no. test_coordinator_property.py checks that
every hit is right under any operations; these check that the hits and counts
that should happen do, to the block."""

from __future__ import annotations

import pytest

from engine.config.cache_groups import KVCacheGroups, SpanGroup
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.hashing import chain_hash
from engine.sampling_params import SamplingParams
from engine.scheduler_output import HOLE
from engine.sequence import Sequence

ROOT = b"r" * 32
TOKENS = [1, 2, 3, 4, 5, 6, 7, 8, 9]


def coordinator(num_blocks: int = 20, window: int = 4, caching: bool = True) -> KVCacheCoordinator:
    groups = KVCacheGroups(2, window, (SpanGroup(4),))
    return KVCacheCoordinator(num_blocks, groups, caching, ROOT)


def seq(tokens: list[int]) -> Sequence:
    return Sequence("s", tokens, SamplingParams())


def names(tokens: list[int], n: int) -> list[bytes]:
    """The chain's names of the first ``n`` token blocks of 2."""
    out, parent = [], ROOT
    for i in range(n):
        parent = chain_hash(parent, tuple(tokens[2 * i : 2 * i + 2]))
        out.append(parent)
    return out


def span(name: bytes, group: int = 1) -> bytes:
    return chain_hash(name, (-group,))


def computed(bm: KVCacheCoordinator, tokens: list[int]) -> Sequence:
    """A sequence of ``tokens`` allocated, computed and published."""
    s = seq(tokens)
    assert bm.allocate(s, len(tokens))
    s.num_computed_tokens = len(tokens)
    bm.cache_full_blocks(s)
    return s


def test_the_groups_as_the_coordinator_counts_them() -> None:
    bm = coordinator()
    assert (bm.spans, bm.per_span, bm.unit, bm.window) == ([4], [2], 2, 4)
    assert KVCacheCoordinator.window_changes_keys is False
    groups = KVCacheGroups(2, 0, (SpanGroup(4), SpanGroup(6)))
    two = KVCacheCoordinator(8, groups, True, ROOT)
    assert (two.spans, two.per_span, two.unit) == ([4, 6], [2, 3], 6)  # lcm 12 tokens
    assert [bm.group_blocks_needed(g, n) for g in (0, 1) for n in (0, 4, 5)] == [0, 2, 3, 0, 1, 2]
    assert two.group_blocks_needed(2, 7) == 2
    assert bm.span_name(b"x" * 32, 1) == chain_hash(b"x" * 32, (-1,)) != bm.span_name(b"x" * 32, 2)


def test_allocate_grows_every_table_all_or_nothing() -> None:
    bm = coordinator(num_blocks=6)
    a = seq(TOKENS[:5])
    assert bm.allocate(a, 5)  # 3 token blocks, 2 row blocks: 5 of 6
    assert a.block_tables == [[0, 1, 2], [3, 4]] and bm.num_free_blocks == 1
    assert bm.allocate(a, 6) and a.block_tables == [[0, 1, 2], [3, 4]]  # room already
    b = seq([1, 2])
    assert not bm.allocate(b, 1)  # a token block and a row block: 2 > 1 free
    assert b.block_tables == [[], []] and bm.num_free_blocks == 1
    assert bm.allocate(a, 7) and a.block_tables == [[0, 1, 2, 5], [3, 4]]
    assert bm.num_free_blocks == 0 and not bm.allocate(a, 9)  # one more of each: none free
    assert a.block_tables == [[0, 1, 2, 5], [3, 4]]


def test_free_gives_back_row_blocks_then_token_blocks_each_tail_first() -> None:
    bm = coordinator(num_blocks=8)
    a = seq(TOKENS[:5])
    bm.allocate(a, 5)  # [[0, 1, 2], [3, 4]]
    bm.free(a)
    assert a.block_tables == [[]] and bm.num_free_blocks == 8
    # Unpublished blocks go to the front as freed, so the last freed comes first.
    assert list(bm.free_blocks)[:5] == [0, 1, 2, 3, 4]
    assert all(bm.blocks[b].ref_count == 0 for b in range(8))


def test_free_tail_cuts_every_table_to_the_tokens_kept() -> None:
    bm = coordinator(num_blocks=10)
    a = seq(TOKENS)
    bm.allocate(a, 9)  # [[0..4], [5, 6, 7]]
    bm.free_tail(a, 5)  # 3 token blocks, 2 row blocks kept
    assert a.block_tables == [[0, 1, 2], [5, 6]]
    assert list(bm.free_blocks)[:4] == [7, 4, 3, 8]  # each given back to the front
    bm.free_tail(a, 4)  # 4 tokens: 2 token blocks and 1 row block
    assert a.block_tables == [[0, 1], [5]]
    assert [bm.blocks[b].ref_count for b in range(10)] == [1, 1, 0, 0, 0, 1, 0, 0, 0, 0]


def test_publishing_names_token_blocks_and_each_whole_spans_row_block() -> None:
    bm = coordinator()
    a = seq(TOKENS)
    bm.allocate(a, 9)  # [[0..4], [5, 6, 7]]
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a, 6)  # 3 token blocks, 1 whole span
    n = names(TOKENS, 4)
    assert bm.cached_blocks == {n[0]: 0, n[1]: 1, n[2]: 2, span(n[1]): 5}
    a.num_unwindowed_tokens = 2  # a window gave blocks back: V4's keys do not change
    bm.cache_full_blocks(a)
    assert bm.cached_blocks == {n[0]: 0, n[1]: 1, n[2]: 2, n[3]: 3, span(n[1]): 5, span(n[3]): 6}
    assert bm.blocks[6].hash == span(n[3]) and bm.blocks[7].hash is None
    b = computed(bm, TOKENS)  # a twin: the first writer's blocks stay published
    assert bm.cached_blocks[span(n[3])] == 6 and bm.blocks[b.block_tables[1][1]].hash is None


def test_a_hit_hands_over_whole_spans_and_the_window_it_reads() -> None:
    bm = coordinator(num_blocks=10)
    a = computed(bm, TOKENS)  # [[0..4], [5, 6, 7]]
    bm.free(a)
    n = names(TOKENS, 4)
    b = seq(TOKENS[:8] + [50, 51, 52])
    hits = bm.match_prefix(b.token_ids)
    assert hits == [HOLE, HOLE, 2, 3]  # 8 tokens; the window of 4 reads blocks 2 and 3
    assert bm.can_admit(hits, 8 + 8)  # 4 token + 2 row blocks fresh: 6 of 10 - 4 idle hits
    assert not bm.can_admit(hits, 8 + 9)  # 5 + 3 fresh
    bm.take_cached(b, hits)
    assert b.block_tables == [[HOLE, HOLE, 2, 3], [5, 6]] and b.block_hashes == n
    assert b.num_computed_tokens == 8 and bm.num_free_blocks == 6
    assert [bm.blocks[x].ref_count for x in (2, 3, 5, 6)] == [1, 1, 1, 1]
    assert not {2, 3, 5, 6} & set(bm.free_blocks)
    # Held now, the hit's blocks are not idle: the same ask needs 6 of 6 free.
    c = seq(TOKENS[:8] + [60])
    hits = bm.match_prefix(c.token_ids)
    assert hits == [HOLE, HOLE, 2, 3] and bm.can_admit(hits, 8 + 8)
    assert not bm.can_admit(hits, 8 + 9)
    with pytest.raises(AssertionError, match="^hits come from match_prefix$"):
        bm.can_admit([HOLE, HOLE, 2, 3], 9)  # an equal list, not the one it returned


def test_a_hit_stops_at_the_last_whole_span_its_blocks_allow() -> None:
    bm = coordinator(num_blocks=12)
    computed(bm, TOKENS)
    n = names(TOKENS, 4)
    assert bm.match_prefix(TOKENS[:8]) == [0, 1]  # the last token never: one span
    assert bm._last.spans == [[5]] and bm._last.names == n[:2]
    assert bm.match_prefix(TOKENS[:5]) == [0, 1] and bm.match_prefix(TOKENS[:4]) == []
    del bm.cached_blocks[span(n[3])]  # the second span's rows gone: one span hits
    assert bm.match_prefix(TOKENS) == [0, 1] and bm._last.spans == [[5]]
    bm.cached_blocks[span(n[3])] = 6
    bm.blocks[3].token_ids = (7, 0)  # block 3 under another chunk: a hash collision
    assert bm.match_prefix(TOKENS) == [0, 1]
    bm.blocks[3].token_ids = (7, 8)
    assert bm.match_prefix(TOKENS) == [HOLE, HOLE, 2, 3]
    unwindowed = coordinator(num_blocks=12, window=0)
    computed(unwindowed, TOKENS)
    assert unwindowed.match_prefix(TOKENS) == [0, 1, 2, 3]  # no window: every block
    off = coordinator(caching=False)
    computed(off, TOKENS)
    assert off.match_prefix(TOKENS) == [] and off.cached_blocks == {}


def test_taking_no_hit_makes_empty_tables() -> None:
    bm = coordinator()
    before = seq(TOKENS)  # no match asked yet: no hit to take
    assert bm.can_admit([], 9)
    bm.take_cached(before, [])
    assert before.block_tables == [[], []] and before.num_computed_tokens == 0
    computed(bm, TOKENS)
    assert bm.match_prefix(TOKENS) == [HOLE, HOLE, 2, 3]  # another request's hit
    late = seq(TOKENS)  # then no hit: none of that one's blocks or names
    assert bm.can_admit([], 16) and not bm.can_admit([], 17)  # 8 + 4 fresh of 12 free
    bm.take_cached(late, [])
    assert late.block_tables == [[], []] and late.block_hashes == []
    bm = coordinator()  # nothing cached: the match is empty
    s = seq(TOKENS)
    hits = bm.match_prefix(s.token_ids)
    assert hits == [] and bm.can_admit(hits, 9)
    bm.take_cached(s, hits)
    assert s.block_tables == [[], []] and s.block_hashes == [] and s.num_computed_tokens == 0


def test_a_twins_span_block_stays_private_after_the_first_writers_goes() -> None:
    bm = coordinator(num_blocks=20)
    a = computed(bm, TOKENS[:4])  # [[0, 1], [2]], published
    b = computed(bm, TOKENS[:4])  # [[3, 4], [5]]: a twin, left private
    n = names(TOKENS, 4)
    bm.free(a)
    c = seq(list(range(100, 122)))
    assert bm.allocate(c, 22)  # 11 + 6: every free block, a's cached ones last
    assert not {n[0], n[1], span(n[1])} & set(bm.cached_blocks)
    bm.free_tail(c, 12)  # 8 back, unpublished
    b.token_ids += TOKENS[4:8]
    assert bm.allocate(b, 8)
    b.num_computed_tokens = 8
    bm.cache_full_blocks(b)  # its next span: published; its first stays private
    assert span(n[3]) in bm.cached_blocks and span(n[1]) not in bm.cached_blocks
    assert bm.blocks[5].hash is None
