"""The verify-length schedule's numbers pinned on constructed cases
(engine/spec_decode/verify_length.py): the step-time profile's interpolation
at, between, before and past its points, and its file; each draft's gain; how
many drafts each request verifies when the step time decides, when the budget
does, when gains tie, and when a gain adds nothing; and which drafts the
schedule leaves whole. Every expected value is worked in the test, and the
profiles' times are exact binary fractions, so the comparisons are exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.spec_decode import Draft
from engine.spec_decode.verify_length import (
    ConfidenceSchedule,
    StepShape,
    StepTimeProfile,
    choose_lengths,
    gains,
)

FLAT = StepTimeProfile((1, 64), (1.0, 1.0))  # every token free: only the budget binds
# 1 s for the first token, then 1/8 s for each of the next seven, 1/4 s past the 8th.
BENT = StepTimeProfile((1, 8, 16), (1.0, 1.875, 3.875))


def sure(*confidence: float) -> Draft:
    return Draft(list(range(10, 10 + len(confidence))), None, confidence)


# ------------------------------------------------------------ the step-time profile


def test_the_profile_interpolates_between_its_points_and_extends_its_end_slopes() -> None:
    p = StepTimeProfile((1, 2, 4), (1.0, 3.0, 4.0))
    assert [p.time(n) for n in (0, 1, 2, 3, 4, 6, 8)] == [-1.0, 1.0, 3.0, 3.5, 4.0, 5.0, 6.0]
    assert [BENT.time(n) for n in (1, 2, 8, 9, 12, 16, 20)] == [
        1.0,
        1.125,
        1.875,
        2.125,
        2.875,
        3.875,
        4.875,
    ]


NOT_ENOUGH = "a step-time profile needs two or more (tokens, seconds) points"
NOT_INCREASING = "a step-time profile's token counts must increase"


@pytest.mark.parametrize(
    "tokens,seconds,message",
    [
        ((1,), (1.0,), NOT_ENOUGH),
        ((), (), NOT_ENOUGH),
        ((1, 2, 3), (1.0, 2.0), NOT_ENOUGH),
        ((1, 2), (1.0, 2.0, 3.0), NOT_ENOUGH),
        ((2, 2), (1.0, 2.0), NOT_INCREASING),
        ((1, 3, 2), (1.0, 2.0, 3.0), NOT_INCREASING),
        ((1, 2, 3, 3), (1.0, 2.0, 3.0, 4.0), NOT_INCREASING),
    ],
)
def test_a_bad_profile_is_refused_with_its_fault(tokens, seconds, message: str) -> None:
    with pytest.raises(ValueError) as error:
        StepTimeProfile(tokens, seconds)
    assert str(error.value) == message


def test_the_smallest_good_profiles_are_taken() -> None:
    assert StepTimeProfile((1, 2), (1.0, 1.0)).time(3) == 1.0
    assert StepTimeProfile((1, 2, 3), (1.0, 2.0, 2.0)).time(3) == 2.0


def test_a_profile_file_holds_its_points_under_tokens_and_seconds(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    BENT.save(path)
    assert json.loads(path.read_text()) == {"tokens": [1, 8, 16], "seconds": [1.0, 1.875, 3.875]}
    assert StepTimeProfile.load(path) == BENT
    path.write_text('{"seconds": [2.0, 5.0], "tokens": [3, 9]}')
    assert StepTimeProfile.load(str(path)) == StepTimeProfile((3, 9), (2.0, 5.0))


# ------------------------------------------------------------ gains


def test_each_gain_is_the_product_of_the_confidences_up_to_it() -> None:
    assert gains(sure(0.5, 0.5, 0.25)) == [0.5, 0.25, 0.0625]
    assert gains(sure(1.0, 0.75)) == [1.0, 0.75]
    assert gains(sure()) == []
    assert gains(Draft([1, 2])) == []  # no confidences: nothing for the schedule to spend


# ------------------------------------------------------------ choose_lengths


def test_drafts_are_taken_while_the_expected_rate_rises_and_not_one_more() -> None:
    """BENT, one decode (1 token, 1 sure output). Each draft adds 1/8 s while the
    step stays within 8 tokens: a gain g pays while (e + g) / (t + 1/8) > e / t.
    Gains 0.5, 0.25, 0.125, 0.0625: 1.5/1.125 > 1/1; 1.75/1.25 > 1.5/1.125;
    1.875/1.375 (1.364) < 1.75/1.25 (1.4): two drafts."""
    drafts = {"a": sure(0.5, 0.5, 0.5, 0.5)}
    assert choose_lengths(drafts, StepShape(1, 1), 8, BENT) == {"a": 2}
    # Seven decodes (7 tokens, 7 outputs): the first draft costs 1/8 s (to 8 tokens),
    # the next 1/4 s. (7 + 0.5) / 1.875 = 4 > 7 / 1.75 = 4; the rate does not rise.
    assert choose_lengths(drafts, StepShape(7, 7), 8, BENT) == {"a": 0}
    # Gains 0.75, 0.75: 7.75 / 1.875 (4.13) > 4, then 8.5 / 2.125 = 4 < 4.13.
    assert choose_lengths({"a": sure(0.75, 1.0)}, StepShape(7, 7), 8, BENT) == {"a": 1}
    # Six decodes and a prefill chunk of 1 (7 tokens, 6 outputs): 6.5/1.875 > 6/1.75.
    assert choose_lengths(drafts, StepShape(7, 6), 8, BENT) == {"a": 1}


def test_each_draft_taken_adds_one_token_to_the_step() -> None:
    """A second token costs nothing, a third a whole second, a fourth nothing
    again. One decode, gains 0.5 and 0.25: the first draft pays (1.5 / 1 > 1 / 1);
    the second would make the step 3 tokens: 1.75 / 2 < 1.5 / 1. (Counted as two
    tokens further on, at 4 against 3, it would seem to pay: 1.75 / 2 > 1.5 / 2.)"""
    steps = StepTimeProfile((1, 2, 3, 4), (1.0, 1.0, 2.0, 2.0))
    assert choose_lengths({"a": sure(0.5, 0.5)}, StepShape(1, 1), 8, steps) == {"a": 1}
    assert choose_lengths({"a": sure(0.5, 0.5)}, StepShape(2, 1), 8, steps) == {"a": 0}


def test_a_draft_that_adds_nothing_is_not_taken() -> None:
    # Free tokens: a gain of 0 leaves the rate where it was, which is no rise.
    assert choose_lengths({"a": sure(0.0, 1.0)}, StepShape(1, 1), 8, FLAT) == {"a": 0}
    assert choose_lengths({"a": sure(1.0, 0.0)}, StepShape(1, 1), 8, FLAT) == {"a": 1}
    assert choose_lengths({"a": sure(0.5, 0.5)}, StepShape(1, 0), 8, FLAT) == {"a": 2}


def test_the_budget_is_the_number_of_draft_tokens_taken() -> None:
    drafts = {"a": sure(0.9, 0.9, 0.9), "b": sure(0.8, 0.8, 0.8)}
    # Gains: a 0.9, 0.81, 0.729; b 0.8, 0.64, 0.512. Best first: a0 a1 b0 a2 b1 b2.
    expected = [
        {"a": 0, "b": 0},
        {"a": 1, "b": 0},
        {"a": 2, "b": 0},
        {"a": 2, "b": 1},
        {"a": 3, "b": 1},
        {"a": 3, "b": 2},
        {"a": 3, "b": 3},
        {"a": 3, "b": 3},
    ]
    for budget, lengths in enumerate(expected):
        assert choose_lengths(drafts, StepShape(2, 2), budget, FLAT) == lengths, budget


def test_equal_gains_go_first_to_a_request_s_earlier_drafts_then_in_request_order() -> None:
    # Gains a: 1, 1, 0.5; b: 1, 0.5. Among the 1s, position 0 (a's, then b's) before
    # a's position 1; among the 0.5s, b's position 1 before a's position 2.
    drafts = {"a": sure(1.0, 1.0, 0.5), "b": sure(1.0, 0.5)}
    lengths = [choose_lengths(drafts, StepShape(2, 2), n, FLAT) for n in range(6)]
    assert lengths == [
        {"a": 0, "b": 0},
        {"a": 1, "b": 0},
        {"a": 1, "b": 1},
        {"a": 2, "b": 1},
        {"a": 2, "b": 2},
        {"a": 3, "b": 2},
    ]
    # In request order among equal gains at one position.
    swapped = {"b": sure(1.0, 0.5), "a": sure(1.0, 1.0, 0.5)}
    assert choose_lengths(swapped, StepShape(2, 2), 1, FLAT) == {"b": 1, "a": 0}


def test_every_request_gets_a_length_even_with_no_drafts_scored() -> None:
    assert choose_lengths({"a": sure(), "b": Draft([5])}, StepShape(2, 2), 4, FLAT) == {
        "a": 0,
        "b": 0,
    }
    assert choose_lengths({}, StepShape(2, 2), 4, FLAT) == {}


# ------------------------------------------------------------ the schedule


def test_the_schedule_cuts_scored_drafts_and_leaves_the_rest_whole() -> None:
    schedule = ConfidenceSchedule(budget=3, profile=FLAT)
    assert (schedule.budget, schedule.profile) == (3, FLAT)
    unscored = Draft([7, 8, 9, 10])
    drafts = {"u": unscored, "a": sure(0.9, 0.9, 0.9), "b": sure(0.85, 0.5)}
    cut = schedule.cut(drafts, StepShape(3, 3))
    assert cut["u"] is unscored
    # Gains a: 0.9, 0.81, 0.729; b: 0.85, 0.425. The best three: a0, b0, a1.
    assert cut["a"] == Draft([10, 11], None, (0.9, 0.9))
    assert cut["b"] == Draft([10], None, (0.85,))
    assert list(cut) == ["u", "a", "b"]
    assert ConfidenceSchedule(budget=0, profile=FLAT).cut(drafts, StepShape(3, 3)) == {
        "u": unscored,
        "a": Draft([], None, ()),
        "b": Draft([], None, ()),
    }
