"""The incremental detokenizer pinned to exact values (issue 49): its decoding
window's offsets token by token, the characters it holds back, where a stop
string cuts the text and from which output token on, what a stream may show,
and the text spelled at once. The tiny checkpoint's byte-level tokenizer
(snippets/models/deepinfer-tiny): "é" takes two tokens, so a character spans steps."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from engine.core.detokenizer import CONTEXT_TOKENS, IncrementalDetokenizer
from tests.conftest import ROOT

TOK = Tokenizer.from_file(str(ROOT / "snippets" / "models" / "deepinfer-tiny" / "tokenizer.json"))
PROMPT = [706, 478, 1132, 2311, 14, 706, 478]  # "The cache stop here.The cache"
HELLO = [40, 1472, 277, 1653, 1080]  # "H", "el", "lo", " wor", "ld"
CAFE = [67, 1435, 128, 103, 221]  # "c", "af", then "é" in two tokens, " "


def detok(stop: list[str] | None = None, **kw) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TOK, PROMPT, stop or [], **kw)


def test_the_window_starts_with_the_prompts_last_five_tokens() -> None:
    assert CONTEXT_TOKENS == 5
    d = detok()
    assert d.token_ids == PROMPT[-5:] and d.token_ids is not PROMPT
    assert (d.prefix_offset, d.read_offset, d.num_output_tokens, d.text) == (0, 5, 0, "")
    short = IncrementalDetokenizer(TOK, [706, 478], [])
    assert short.token_ids == [706, 478] and short.read_offset == 2
    assert (d.min_tokens, d.include_stop_str, d.stop) == (0, False, [])


def test_offsets_advance_only_once_a_character_is_whole() -> None:
    d = detok()
    seen = []
    for token in CAFE:
        assert d.update([token], finished=False) is False
        seen.append((d.text, d.prefix_offset, d.read_offset, d.num_output_tokens))
    assert seen == [
        ("c", 5, 6, 1),
        ("caf", 6, 7, 2),
        ("caf", 6, 7, 3),  # half of "é": held back, offsets kept
        ("café", 7, 9, 4),
        ("café ", 9, 10, 5),
    ]


def test_finishing_flushes_a_broken_character() -> None:
    d = detok()
    assert d.update(CAFE[:3], finished=True) is False
    assert d.text == "caf\ufffd"
    assert (d.prefix_offset, d.read_offset, d.num_output_tokens) == (8, 8, 3)
    assert d.visible_text(False) == "caf\ufffd"


def test_a_stop_token_shows_its_text_only_with_include_stop_str() -> None:
    d = detok()
    assert d.update(HELLO, finished=True, stop_token=True) is False
    assert d.text == "Hello wor" and d.num_output_tokens == 4
    d = detok(include_stop_str=True)
    d.update(HELLO, finished=True, stop_token=True)
    assert d.text == "Hello world" and d.num_output_tokens == 5
    d = detok()
    d.update(HELLO, finished=True)
    assert d.text == "Hello world" and d.num_output_tokens == 5


def test_a_stop_string_spanning_tokens_cuts_the_text_before_or_after_it() -> None:
    d = detok(["lo w"])
    assert d.update(HELLO[:3], finished=False) is False
    assert d.update(HELLO[3:], finished=False) is True
    assert d.text == "Hel" and d.num_output_tokens == 4  # stops at the token that ends it
    d = detok(["lo w"], include_stop_str=True)
    assert d.update(HELLO, finished=False) is True and d.text == "Hello w"


def test_the_first_of_two_stop_strings_wins() -> None:
    d = detok(["ld", "o w", "wor"])
    assert d.update(HELLO, finished=False) is True and d.text == "Hell"
    d = detok(["wor", "o w"], include_stop_str=True)
    d.update(HELLO, finished=False)
    assert d.text == "Hello w"


def test_only_the_tail_is_searched_for_a_new_stop_string() -> None:
    """ "el" ends in token 2; with min_tokens 2 it may not stop there, and the
    later tokens' tails ("Hello", from index 2) no longer hold it."""
    d = detok(["el"], min_tokens=2)
    assert d.update(HELLO, finished=False) is False and d.text == "Hello world"
    d = detok(["el"], min_tokens=1)
    assert d.update(HELLO, finished=False) is True and d.text == "H"
    d = detok(["He"], min_tokens=1)  # ends within token 2's text ("el"), starts before
    assert d.update(HELLO, finished=False) is True and d.text == ""


def test_a_stop_string_may_end_in_the_flushed_bytes() -> None:
    d = detok(["f\ufffd"])
    assert d.update(CAFE[:3], finished=False) is False and d.text == "caf"
    assert d.update([], finished=True) is True and d.text == "ca"
    assert detok(["zz"]).update([], finished=True) is False


def test_visible_text_holds_back_a_possible_stop_strings_start() -> None:
    d = detok(["xyz", "q"])
    d.update(HELLO[:1], finished=False)
    assert d.visible_text(False) == ""  # "H" could start "xyz": held back
    d.update(HELLO[1:], finished=False)
    assert d.visible_text(False) == "Hello wor"  # the last 2 held back
    assert d.visible_text(True) == "Hello world"
    assert detok(["xyz"], include_stop_str=True).visible_text(False) == ""
    d = detok(["xyz"], include_stop_str=True)
    d.update(HELLO[:2], finished=False)
    assert d.visible_text(False) == "Hel"
    d = detok()
    d.update(HELLO[:2], finished=False)
    assert d.visible_text(False) == "Hel"


def test_finish_at_once_spells_what_update_would() -> None:
    d = detok()
    d.finish_at_once(CAFE)
    assert d.text == "café " and d.num_output_tokens == 5
    assert (d.prefix_offset, d.read_offset) == (10, 10)
    d = detok()
    d.finish_at_once(HELLO, stop_token=True)
    assert d.text == "Hello wor" and d.num_output_tokens == 4
    d = detok(include_stop_str=True)
    d.finish_at_once(HELLO, stop_token=True)
    assert d.text == "Hello world" and d.num_output_tokens == 5
    with pytest.raises(AssertionError) as err:
        detok(["x"]).finish_at_once(HELLO)
    assert str(err.value) == "stop strings are found as the text grows: use update"


def test_finish_at_once_after_tokens_already_shown_adds_to_them() -> None:
    """A handed-on request's client saw its first tokens; the rest come at once."""
    d = detok()
    d.update(HELLO[:2], finished=False)
    d.finish_at_once(HELLO[2:])
    assert d.text == "Hello world" and d.num_output_tokens == 5


def test_a_stop_string_twice_in_one_token_cuts_at_the_first() -> None:
    d = detok(["c"])
    assert d.update([478], finished=False) is True  # " cache"
    assert d.text == " "
    d = detok(["c"], include_stop_str=True)
    d.update([478], finished=False)
    assert d.text == " c"


def test_a_token_that_adds_no_text_moves_no_offset() -> None:
    d = detok()
    d.update([0], finished=False)  # "<|endoftext|>", a special token: decoded as nothing
    assert (d.text, d.prefix_offset, d.read_offset, d.num_output_tokens) == ("", 0, 5, 1)
