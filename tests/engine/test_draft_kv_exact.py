"""The draft model's cache bookkeeping pinned to exact values (issue 49): how many
tokens a rollback keeps, which blocks it gives back, how many slots a proposal
reserves, and whose blocks go when the cache is full. None of it changes a
token the target accepts, so only exact counts show a mistake."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.spec_decode.draft_kv import DraftKV, common_prefix
from engine.spec_decode.proposer import DraftRequest

PARAMS = SamplingParams(temperature=0.0)


def request(req_id: str, tokens: list[int], seed: int = 7) -> DraftRequest:
    return DraftRequest(
        token_ids=tokens, num_prompt_tokens=2, request_id=req_id, params=PARAMS, seed=seed
    )


def test_common_prefix_stops_at_the_first_wrong_token_and_before_the_newest() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], limit=3) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], limit=2) == 2  # only what was computed
    assert common_prefix([1, 9, 3], [1, 2, 3, 4], limit=3) == 1
    assert common_prefix([9, 2, 3], [1, 2, 3, 4], limit=3) == 0
    assert common_prefix([1, 2, 3], [1, 2, 3], limit=3) == 2  # the newest is fed again
    assert common_prefix([1, 2], [1, 2, 3, 4], limit=5) == 2  # no more than was written
    assert common_prefix([], [1], limit=0) == 0


def test_a_new_request_gets_a_shadow_with_blocks_for_its_tokens_and_guesses() -> None:
    kv = DraftKV(num_blocks=8, block_size=4)
    shadow = kv.catch_up(request("a", [1, 2, 3, 4, 5], seed=11), num_drafts=4, busy={"a"})
    assert shadow is kv.shadows["a"]
    assert (shadow.request_id, shadow.params, shadow.seed) == ("a", PARAMS, 11)
    assert shadow.token_ids == [1, 2, 3, 4, 5] and shadow.num_computed_tokens == 0
    assert len(shadow.block_table) == 2  # 5 + 4 - 1 = 8 slots: two blocks of four
    assert kv.blocks.num_free_blocks == 6
    kv.catch_up(request("b", [1, 2, 3, 4, 5]), num_drafts=5, busy={"b"})
    assert len(kv.shadows["b"].block_table) == 3  # 5 + 5 - 1 = 9 slots
    assert kv.blocks.num_free_blocks == 3


def test_a_rollback_keeps_the_right_guesses_and_gives_back_the_blocks_past_them() -> None:
    kv = DraftKV(num_blocks=8, block_size=4)
    shadow = kv.catch_up(request("a", [1, 2, 3]), num_drafts=3, busy={"a"})
    shadow.num_computed_tokens = 3
    for guess in (10, 11, 12, 13, 14, 15):
        kv.wrote(shadow, guess)
    assert shadow.token_ids == [1, 2, 3, 10, 11, 12, 13, 14, 15]
    assert shadow.num_computed_tokens == 9 and len(shadow.block_table) == 2
    kv.blocks.allocate(shadow, 12)  # as if it had reserved for more guesses
    assert len(shadow.block_table) == 3
    # The target kept 10 and 11, then chose 20: 5 tokens stay, the rest is redone.
    again = kv.catch_up(request("a", [1, 2, 3, 10, 11, 20]), num_drafts=2, busy={"a"})
    assert again is shadow and shadow.token_ids == [1, 2, 3, 10, 11, 20]
    assert shadow.num_computed_tokens == 5
    assert len(shadow.block_table) == 2 and kv.blocks.num_free_blocks == 6  # 6 + 2 - 1 slots


def test_a_full_cache_gives_back_idle_requests_blocks_first() -> None:
    kv = DraftKV(num_blocks=4, block_size=4)
    kv.catch_up(request("idle", [1, 2, 3, 4, 5]), num_drafts=1, busy={"idle"})
    kv.catch_up(request("busy", [1, 2, 3, 4, 5]), num_drafts=1, busy={"busy"})
    assert kv.blocks.num_free_blocks == 0
    shadow = kv.catch_up(request("new", [1, 2, 3]), num_drafts=2, busy={"busy", "new"})
    assert shadow is not None and len(shadow.block_table) == 1
    assert set(kv.shadows) == {"busy", "new"} and kv.blocks.num_free_blocks == 1
    # Nothing idle left, and not enough room: the request is dropped, not half-held.
    assert (
        kv.catch_up(request("big", list(range(20))), num_drafts=1, busy=set(kv.shadows) | {"big"})
        is None
    )
    assert set(kv.shadows) == {"busy", "new"} and kv.blocks.num_free_blocks == 1


def test_forget_gives_back_every_block_once() -> None:
    kv = DraftKV(num_blocks=4, block_size=4)
    kv.catch_up(request("a", [1, 2, 3, 4, 5]), num_drafts=1, busy={"a"})
    kv.forget(["a", "a", "never"])
    assert kv.shadows == {} and kv.blocks.num_free_blocks == 4
