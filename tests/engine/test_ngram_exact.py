"""The n-gram proposer's drafts pinned on constructed token lists
(engine/spec_decode/ngram.py): which suffix length it searches first and last,
which occurrence it takes, where the search must stop, the byte search's
alignment, and how many tokens it proposes. Each case is built so that a
search one token longer or shorter, or one byte off, proposes something else."""

from __future__ import annotations

from engine.sampling_params import SamplingParams
from engine.spec_decode import Draft, DraftRequest, SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer, _rfind_aligned, propose_ngram

# 0x01010101: all four bytes equal, so it also occurs one byte into itself and
# the token after it, when that token's low byte is 1 too.
SAME_BYTES = 0x01010101


def test_a_request_as_long_as_lookup_min_plus_one_still_searches_lookup_min() -> None:
    # The only suffix of two tokens that can have occurred before is tokens[1:],
    # at 0: it recurs exactly when the tokens are all equal.
    assert propose_ngram([5, 5, 5], 2, 2, 2) == [5]
    assert propose_ngram([5, 5, 5], 2, 9, 2) == [5]
    assert propose_ngram([5, 6, 5], 2, 2, 2) == []
    assert propose_ngram([5, 5], 1, 1, 3) == [5]
    assert propose_ngram([5, 5], 2, 2, 3) == []  # no token after a 2-gram of 2 tokens
    assert propose_ngram([5], 1, 1, 3) == []
    assert propose_ngram([], 1, 3, 3) == []


def test_lookup_min_is_the_shortest_suffix_searched() -> None:
    tokens = [3, 4, 8, 9, 1, 4]  # only the 1-gram [4] recurs
    assert propose_ngram(tokens, 1, 3, 3) == [8, 9, 1]
    assert propose_ngram(tokens, 2, 3, 3) == []


def test_lookup_max_is_the_longest_suffix_searched() -> None:
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 7, 9, 2, 3, 8, 1, 2, 3]
    # [1, 2, 3] occurred at 0 (then 7); [2, 3] last at 5 (then 8).
    assert propose_ngram(tokens, 1, 3, 2) == [7, 9]
    assert propose_ngram(tokens, 1, 2, 2) == [8, 1]
    assert propose_ngram(tokens, 3, 3, 2) == [7, 9]
    assert propose_ngram(tokens, 4, 4, 2) == []


def test_every_length_between_the_bounds_is_searched_longest_first() -> None:
    #        0  1  2  3  4  5  6
    tokens = [2, 3, 8, 3, 9, 2, 3]
    # [9, 2, 3] never occurred; [2, 3] did, at 0 (then 8); [3] last at 3 (then 9).
    assert propose_ngram(tokens, 1, 3, 1) == [8]
    assert propose_ngram(tokens, 1, 1, 1) == [9]


def test_the_newest_token_itself_is_no_earlier_occurrence() -> None:
    # [2] occurs at the very end, and earlier at 1, where 6 followed it.
    assert propose_ngram([9, 2, 6, 7, 2], 1, 1, 1) == [6]
    assert propose_ngram([9, 2, 6, 7, 2], 1, 1, 4) == [6, 7, 2]
    # An occurrence may overlap the suffix, as long as it ends before the newest token.
    assert propose_ngram([4, 4, 4, 4], 3, 3, 2) == [4]
    assert propose_ngram([4, 4, 4, 4], 2, 2, 2) == [4]  # the latest: tokens 1 and 2


def test_k_tokens_are_proposed_and_no_more() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1]
    assert propose_ngram(tokens, 1, 1, 1) == [2]
    assert propose_ngram(tokens, 1, 1, 3) == [2, 3, 4]
    assert propose_ngram(tokens, 1, 1, 6) == [2, 3, 4, 5, 6, 1]
    assert propose_ngram(tokens, 1, 1, 7) == [2, 3, 4, 5, 6, 1]


def test_a_match_that_starts_inside_a_token_is_skipped() -> None:
    # 256 packs as 00 01 00 00 and 0 as 00 00 00 00, so the bytes of [1]
    # (01 00 00 00) occur one byte into 256: no token 1 is there.
    assert propose_ngram([256, 0, 7, 1], 1, 1, 2) == []
    assert propose_ngram([256, 0, 7, 1, 5, 1], 1, 1, 2) == [5, 1]


def test_an_aligned_match_one_byte_before_an_unaligned_one_is_found() -> None:
    # SAME_BYTES then 1: 01 01 01 01 01 00 00 00. [SAME_BYTES] occurs at byte 1
    # (skipped) and at byte 0, the real one, which the search after the skip must
    # still reach.
    tokens = [SAME_BYTES, 1, 5, SAME_BYTES]
    assert propose_ngram(tokens, 1, 1, 3) == [1, 5, SAME_BYTES]
    data = bytes([1, 1, 1, 1, 1, 0, 0, 0])
    assert _rfind_aligned(data, bytes([1, 1, 1, 1]), 8) == 0
    assert _rfind_aligned(data, bytes([1, 0, 0, 0]), 8) == 4
    assert _rfind_aligned(data, bytes([1, 0, 0, 0]), 7) == -1
    assert _rfind_aligned(data, bytes([1, 1, 0, 0]), 8) == -1  # only at byte 3
    assert _rfind_aligned(bytes([0, 1, 0, 0, 0, 0, 0, 0]), bytes([1, 0, 0, 0]), 8) == -1
    assert _rfind_aligned(bytes([0, 1, 0, 0, 0, 0, 0, 0]), bytes([0, 0, 0, 0]), 8) == 4


def test_after_an_unaligned_match_the_search_goes_on_backwards_from_it() -> None:
    # [SAME_BYTES] occurs at token 0, at token 2, and one byte into token 2 (its
    # last three bytes and the low byte of the 1 after it). The latest aligned
    # one, token 2, is the match: 1, 5, ... followed it, not 9, ...
    tokens = [SAME_BYTES, 9, SAME_BYTES, 1, 5, SAME_BYTES]
    assert propose_ngram(tokens, 1, 1, 3) == [1, 5, SAME_BYTES]


def test_the_proposer_takes_k_and_the_lookup_bounds_from_the_config() -> None:
    config = SpeculativeConfig("ngram", 3, prompt_lookup_min=2, prompt_lookup_max=4)
    proposer = NgramProposer.from_config(config)
    assert (proposer.k, proposer.lookup_min, proposer.lookup_max) == (3, 2, 4)
    reqs = [
        DraftRequest("long", SamplingParams(), 0, 2, [1, 2, 3, 4, 5, 6, 1, 2, 3, 4]),
        DraftRequest("short", SamplingParams(), 0, 2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 4]),
        DraftRequest("pair", SamplingParams(), 0, 2, [7, 1, 2, 3, 9, 9, 1, 2]),
    ]
    drafts = proposer.propose(reqs)
    assert drafts == {"long": Draft([5, 6, 1]), "pair": Draft([3, 9, 9])}
    assert drafts["long"].probs is None and drafts["long"].confidence is None
    proposer.forget(["long", "pair"])  # keeps nothing: the next step proposes the same
    assert proposer.propose(reqs) == drafts
