"""The block manager on its own: reference counts, the free list, prefix hits
verified by token ids, LRU reclaim, and invariants over random traces."""

from __future__ import annotations

import random

import pytest

import engine.kv.block_manager as bm_module
from engine.kv.block_manager import BlockManager
from engine.kv.hashing import chain_root
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence


def seq(tokens: list[int]) -> Sequence:
    return Sequence("s", tokens, SamplingParams())


def admit(bm: BlockManager, s: Sequence) -> list[int] | None:
    """As the scheduler admits a whole prompt: the prefix hits, or None if it does not fit."""
    hits = bm.match_prefix(s.token_ids)
    if not bm.can_admit(hits, s.num_tokens):
        return None
    bm.take_cached(s, hits)
    assert bm.allocate(s, s.num_tokens)
    return hits


def compute_all(bm: BlockManager, s: Sequence) -> None:
    s.num_computed_tokens = s.num_tokens
    bm.cache_full_blocks(s)


def test_shared_prefix_is_hit_and_the_last_token_never_is() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = seq(list(range(12)))  # exactly 3 full blocks
    assert admit(bm, a) is not None
    compute_all(bm, a)
    b = seq(list(range(12)))
    assert bm.match_prefix(b.token_ids) == a.block_table[:2]  # the last block is recomputed
    c = seq(list(range(8)) + [99, 98, 97, 96, 1])
    assert bm.match_prefix(c.token_ids) == a.block_table[:2]
    assert admit(bm, c) is not None
    assert c.num_computed_tokens == 8
    assert [bm.blocks[i].ref_count for i in a.block_table] == [2, 2, 1]


def test_a_hash_collision_is_caught_by_the_token_check(monkeypatch) -> None:
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: b"same")
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3])
    admit(bm, a)
    compute_all(bm, a)
    assert bm.match_prefix([1, 2, 3]) == a.block_table[:1]
    assert bm.match_prefix([7, 8, 9]) == []  # same hash, different tokens: a miss


def test_freed_cached_blocks_are_reclaimed_last_and_in_lru_order() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = seq([1, 2, 3]), seq([4, 5, 6])
    admit(bm, a)
    admit(bm, b)
    compute_all(bm, a)  # a's first block is cached; its second is partial
    compute_all(bm, b)
    a_full, a_partial = a.block_table
    b_full, b_partial = b.block_table
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 4
    # Unhashed blocks are reused first (newest first); then cached ones, least
    # recently freed first, forgetting their hashes as they go.
    assert [bm._reclaim() for _ in range(4)] == [b_partial, a_partial, a_full, b_full]
    assert bm.cached_blocks == {}


def test_free_never_releases_a_block_someone_still_holds() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    a = seq([1, 2, 3, 4, 5])
    admit(bm, a)
    compute_all(bm, a)
    b = seq([1, 2, 3, 4, 9])
    admit(bm, b)
    shared = a.block_table[:2]
    bm.free(a)
    for block_id in shared:
        assert bm.blocks[block_id].ref_count == 1
        assert block_id not in bm.free_blocks
    bm.free(b)
    assert bm.num_free_blocks == 8
    with pytest.raises(AssertionError, match="freed more often than held"):
        b.block_tables[0] = [shared[0]]
        bm.free(b)


def check_invariants(bm: BlockManager, live: list[Sequence]) -> None:
    holders: dict[int, int] = {}
    for s in live:
        assert len(set(s.block_table)) == len(s.block_table)
        for block_id in s.block_table:
            holders[block_id] = holders.get(block_id, 0) + 1
        for i, h in enumerate(s.block_hashes):  # a hit's tokens are the sequence's tokens
            block = bm.blocks[s.block_table[i]]
            if block.hash == h:
                assert block.token_ids == tuple(
                    s.token_ids[i * bm.block_size : (i + 1) * bm.block_size]
                )
    for block in bm.blocks:
        assert block.ref_count == holders.get(block.block_id, 0)
        assert (block.block_id in bm.free_blocks) == (block.ref_count == 0)
    for h, block_id in bm.cached_blocks.items():
        assert bm.blocks[block_id].hash == h


@pytest.mark.parametrize("seed", range(20))
def test_random_traces_keep_every_invariant(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_blocks=24, block_size=rng.choice([1, 2, 4]))
    prefixes = [[rng.randrange(5) for _ in range(rng.randrange(1, 12))] for _ in range(3)]
    live: list[Sequence] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.35:
            tokens = rng.choice(prefixes) + [rng.randrange(5) for _ in range(rng.randrange(1, 8))]
            s = seq(tokens)
            if admit(bm, s) is not None:
                live.append(s)
        elif op < 0.7 and live:
            s = rng.choice(live)
            compute_all(bm, s)
            s.token_ids.append(rng.randrange(5))
            if not bm.allocate(s, s.num_tokens):
                bm.free(s)
                live.remove(s)
        elif live:
            s = live.pop(rng.randrange(len(live)))
            bm.free(s)
        check_invariants(bm, live)
    for s in live:
        bm.free(s)
    assert bm.num_free_blocks == 24


def test_caches_of_two_models_formats_or_block_sizes_name_no_block_alike() -> None:
    """The chain starts from the cache's identity: a store that two caches share
    can never hand one of them the other's blocks."""
    tokens = list(range(8))
    roots = {
        chain_root("Llama:a", "bfloat16", 4),
        chain_root("Llama:b", "bfloat16", 4),
        chain_root("Llama:a", "float32", 4),
        chain_root("Llama:a", "bfloat16", 8),
    }
    assert len(roots) == 4
    names = set()
    for root in roots:
        bm = BlockManager(num_blocks=8, block_size=4, root=root)
        s = seq(tokens + [1])
        admit(bm, s)
        compute_all(bm, s)
        names.add(tuple(s.block_hashes))
    assert len(names) == 4


def test_the_engine_roots_its_chains_in_its_model_format_and_block_size(qwen3) -> None:
    from engine.llm import LLM

    llm = LLM(str(qwen3[0]), block_size=8, num_kv_blocks=16)
    config = llm.llm_engine.config
    assert config.kv_cache_dtype == "auto"
    assert llm.llm_engine.block_manager.root == chain_root(
        config.model_identity, str(config.dtype).removeprefix("torch."), 8
    )
