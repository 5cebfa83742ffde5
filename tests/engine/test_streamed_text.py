"""A request's text as its caller sees it, streamed and at the end: the output
processor flushes whatever the detokenizer still holds back when a request
finishes (a half-built character, a possible start of a stop string), and a
stream never shows text that a longer stop string later takes back.

Outputs are typed in by hand as the engine core hands them on, so the test
chooses exactly which tokens end a request; one test runs the whole engine."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine import LLM, SamplingParams
from engine.core.output_processor import OutputProcessor
from engine.outputs import EngineCoreOutput, RequestOutput
from engine.sampling_params import RequestOutputKind
from tests.engine.conftest import VOCAB, random_prompts

PROMPT = "def schedule(self) -> SchedulerOutput:\n"  # ASCII: no character spans into the output


@pytest.fixture(scope="module")
def tok(qwen3: tuple[Path, object]) -> Tokenizer:
    return Tokenizer.from_file(str(qwen3[0] / "tokenizer.json"))


def stream(
    tok: Tokenizer, steps: list[list[int]], params: SamplingParams
) -> tuple[list[RequestOutput], str]:
    """Feed one request's tokens step by step, the last step finishing it by
    length; return every output it got and its streamed deltas joined, cut as
    the server cuts them (the text past what was sent before)."""
    proc = OutputProcessor(tok)
    proc.add_request("r", PROMPT, tok.encode(PROMPT).ids, params)
    outs: list[RequestOutput] = []
    sent = ""
    for i, ids in enumerate(steps):
        reason = "length" if i == len(steps) - 1 else None
        out = proc.process_outputs([EngineCoreOutput("r", ids, finish_reason=reason)])
        outs.append(out.request_outputs[0])
        sent += outs[-1].text[len(sent) :]
        if outs[-1].finished:
            break
    assert outs[-1].finished
    return outs, sent


def ending_mid_character(tok: Tokenizer, text: str) -> list[int]:
    """The longest run of ``text``'s tokens whose decoding ends in a broken character."""
    ids = tok.encode(text).ids
    k = max(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    return ids[:k]


def test_a_request_that_ends_mid_character_keeps_its_last_bytes(tok: Tokenizer) -> None:
    """Bug guarded: the detokenizer not flushing at the end. A request that reaches
    max_tokens inside a multi-byte character still gets every token's text: the
    final text, and the streamed deltas joined, equal decoding all its tokens."""
    ids = ending_mid_character(tok, " done; 東京")
    outs, streamed = stream(tok, [[t] for t in ids], SamplingParams())
    final = outs[-1]
    assert final.finish_reason == "length" and final.token_ids == ids
    assert final.text == tok.decode(ids) and final.text.endswith("\ufffd")
    assert streamed == final.text


def test_the_end_flushes_a_held_back_stop_prefix_and_a_broken_character(
    tok: Tokenizer,
) -> None:
    """Bug guarded: the detokenizer not flushing at the end. At the last token the
    stream is holding back both a possible start of a stop string ("blocks" of
    "blocks!") and a half-built character; the final output shows both."""
    ids = tok.encode(" the free blocks").ids + ending_mid_character(tok, " 東")
    outs, streamed = stream(tok, [[t] for t in ids], SamplingParams(stop=["blocks!", "zz"]))
    assert not outs[-2].text.endswith("blocks")  # held back until the end
    final = outs[-1]
    assert final.finish_reason == "length"
    assert final.text == tok.decode(ids) and final.text.endswith("blocks \ufffd")
    assert streamed == final.text


@pytest.mark.parametrize("stop", [["manager frees", "Q"], ["Q", "manager frees"]])
def test_a_long_stop_string_is_held_back_whole_beside_a_short_one(
    tok: Tokenizer, stop: list[str]
) -> None:
    """Bug guarded: the stream holding back the shortest stop string's length
    instead of the longest. With a one-character stop string beside a long one,
    no streamed delta shows the start of the long one that later ends the text."""
    ids = tok.encode("The block manager frees blocks").ids
    outs, streamed = stream(tok, [[t] for t in ids], SamplingParams(stop=stop))
    final = outs[-1]
    assert final.finish_reason == "stop" and final.text == "The block "
    for out in outs:
        assert final.text.startswith(out.text), (out.text, final.text)
    assert streamed == final.text


def test_the_engine_text_equals_decoding_every_token(qwen3: tuple[Path, object]) -> None:
    """Bug guarded: the detokenizer not flushing at the end, through the whole
    engine: sampled outputs of a random model often end inside a character, and
    each one's text is still the decoding of all its tokens."""
    llm = LLM(qwen3[0], dtype="float32")
    prompts = random_prompts(16, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    decoded = [llm.tokenizer.decode(o.token_ids) for o in outs]
    assert sum(d.endswith("\ufffd") for d in decoded) >= 2  # the case under test occurs
    assert [o.text for o in outs] == decoded


# Token ids of every kind: whole words, single bytes of multi-byte characters, EOS.
TOKENS = st.integers(min_value=2, max_value=VOCAB - 1)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ids=st.lists(TOKENS, min_size=1, max_size=24),
    cuts=st.lists(st.integers(0, 1000), max_size=4),
    widths=st.lists(st.integers(1, 8), max_size=4),
    extra=st.lists(st.sampled_from(["Q", "\n", "zz", " s"]), max_size=2),
    chunk=st.integers(1, 3),
)
def test_streamed_and_final_text_agree_with_decoding_at_once(
    tok: Tokenizer,
    ids: list[int],
    cuts: list[int],
    widths: list[int],
    extra: list[str],
    chunk: int,
) -> None:
    """Any tokens, any stop strings (pieces of the text itself, long and short),
    one to three tokens a step, finished by length unless a stop string ends it:
    every streamed text is a prefix of the final one, so the deltas join to it;
    a request that ran out of tokens has the decoding of all of them; one cut by
    a stop string ends right before it and holds none."""
    full = tok.decode(ids)
    starts = [c % len(full) for c in cuts] if full else []
    stop = [full[c : c + w] for c, w in zip(starts, widths)] + extra
    stop = [s for s in dict.fromkeys(stop) if "\ufffd" not in s]
    steps = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    outs, streamed = stream(tok, steps, SamplingParams(stop=stop))
    final = outs[-1]
    for out in outs:
        assert final.text.startswith(out.text), (out.text, final.text, stop)
    assert streamed == final.text
    decoded = tok.decode(final.token_ids)
    if final.finish_reason == "length":
        assert final.token_ids == ids
        assert final.text == decoded
        assert not any(s in decoded for s in stop)
    else:
        assert final.finish_reason == "stop"
        assert decoded.startswith(final.text)
        assert any(decoded[len(final.text) :].startswith(s) for s in stop)
        assert not any(s in final.text for s in stop)


def byte_level_tokenizer_with(*merged: tuple[str, str]) -> Tokenizer:
    """A byte-level BPE tokenizer over the 256 bytes plus the given merges, as
    GPT-2-style vocabularies have them: a token can hold a whole character and
    the first byte of the next one."""
    from tokenizers import decoders, models
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {c: i for i, c in enumerate(sorted(ByteLevel.alphabet()))}
    for a, b in merged:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merged)))
    tok.pre_tokenizer = ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_a_stop_string_in_the_text_flushed_at_the_end_still_stops() -> None:
    """Bug guarded: the flush at the end skipping the stop-string check. The last
    token is "a" and the first byte of "東" (ByteLevel spells byte 0xE6 as "æ"), so
    its "a" is held back with the broken character; when the request ends there,
    the flushed text holds the stop string "a", and the text is cut before it."""
    tok = byte_level_tokenizer_with(("a", "æ"))
    ids = tok.encode("a東").ids
    assert tok.decode(ids[:1]) == "a\ufffd"  # the merged token: "a", then a broken byte
    proc = OutputProcessor(tok)
    proc.add_request("r", "xy", tok.encode("xy").ids, SamplingParams(stop=["a"]))
    out = proc.process_outputs([EngineCoreOutput("r", ids[:1], finish_reason="length")])
    final = out.request_outputs[0]
    assert (final.text, final.finish_reason) == ("", "stop")
    assert out.reqs_to_abort == []  # the core had finished it already


def final_output(tok: Tokenizer, steps: list[list[int]], params: SamplingParams, reason: str):
    """Feed one request's steps, the last finishing it for ``reason``; every output."""
    proc = OutputProcessor(tok)
    proc.add_request("r", PROMPT, tok.encode(PROMPT).ids, params)
    outs = []
    for i, ids in enumerate(steps):
        done = reason if i == len(steps) - 1 else None
        outs += proc.process_outputs(
            [EngineCoreOutput("r", ids, finish_reason=done)]
        ).request_outputs
    return outs


@settings(max_examples=150, deadline=None, derandomize=True)
@given(
    ids=st.lists(TOKENS, min_size=1, max_size=24),
    chunk=st.integers(1, 3),
    reason=st.sampled_from(["length", "stop"]),
    include_stop_str=st.booleans(),
)
def test_final_only_spells_the_text_cumulative_grows(
    tok: Tokenizer, ids: list[int], chunk: int, reason: str, include_stop_str: bool
) -> None:
    """A FINAL_ONLY request (LLM.generate's) gets one output, at the end, with its
    text spelled in one decode: the same output, text and all, as a CUMULATIVE
    request's last, for any tokens, steps, and a request stopped by its last token
    (whose text shows only with include_stop_str_in_output) or by length."""
    steps = [ids[i : i + chunk] for i in range(0, len(ids), chunk)]
    kinds = [RequestOutputKind.CUMULATIVE, RequestOutputKind.FINAL_ONLY]
    grown, once = (
        final_output(
            tok,
            steps,
            SamplingParams(output_kind=kind, include_stop_str_in_output=include_stop_str),
            reason,
        )
        for kind in kinds
    )
    assert len(grown) == len(steps) and len(once) == 1
    assert (once[0].text, once[0].token_ids, once[0].finish_reason) == (
        grown[-1].text,
        grown[-1].token_ids,
        grown[-1].finish_reason,
    )
