"""Stopping: EOS, stop token ids, stop strings that span token boundaries, and
the length limits; and text that is detokenized one token at a time."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.detokenizer import IncrementalDetokenizer
from tests.engine.conftest import EOS, random_prompts


@pytest.fixture(scope="module")
def llm(qwen3) -> LLM:
    return LLM(qwen3[0], dtype="float32")


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


PROMPT = "def schedule(self) -> SchedulerOutput:"


def test_incremental_text_equals_decoding_everything_at_once(llm) -> None:
    out = llm.generate([PROMPT], greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_incremental_detokenizer_on_multibyte_characters(llm) -> None:
    """Characters split across byte-level tokens appear only once complete."""
    tok = llm.tokenizer
    text = "naïve café — 東京 😀 done"
    ids = tok.encode(text).ids
    detok = IncrementalDetokenizer(tok, ids[:1], stop=[])
    pieces = []
    for t in ids[1:]:
        before = detok.text
        detok.update([t], finished=False)
        piece = detok.text[len(before) :]
        assert "\ufffd" not in piece
        pieces.append(piece)
    assert tok.decode(ids[:1]) + "".join(pieces) == text


def spanning_stop(llm) -> tuple[str, str]:
    """The free-running greedy text, and a stop string in it that straddles a
    token boundary: its first two characters end one token, the rest begin the next."""
    free = llm.generate([PROMPT], greedy(max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    tok = llm.tokenizer
    offsets, pos = [], 0
    for t in free.token_ids:
        pos += len(tok.decode([t]))
        offsets.append(pos)
    boundary = next(o for o in offsets[3:] if 2 <= o < len(free.text) - 2)
    return free, free.text[boundary - 2 : boundary + 2]


def test_stop_string_spanning_tokens_is_cut(llm) -> None:
    free, stop = spanning_stop(llm)
    first = free.text.find(stop)
    out = llm.generate(
        [PROMPT], greedy(max_tokens=40, ignore_eos=True, stop=[stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:first]
    assert free.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(free.token_ids)


def test_streamed_text_holds_back_a_possible_stop_string(llm) -> None:
    """Step by step, the text shown so far never includes the start of a stop
    string that a later token completes: each one is a prefix of the final text."""
    free, stop = spanning_stop(llm)
    engine = llm.llm_engine
    engine.add_request("stream", PROMPT, greedy(max_tokens=40, ignore_eos=True, stop=[stop]))
    streamed = []
    while engine.has_unfinished_requests():
        streamed += [out.text for out in engine.step()]
    final = streamed[-1]
    assert final == free.text[: free.text.find(stop)]
    assert all(final.startswith(text) for text in streamed), (streamed, stop)
    assert len(streamed) > 2


def test_stop_token_ids_and_max_tokens(llm) -> None:
    free = llm.generate([PROMPT], greedy(max_tokens=20, ignore_eos=True), use_tqdm=False)[0]
    target = free.token_ids[5]
    out = llm.generate(
        [PROMPT], greedy(max_tokens=20, ignore_eos=True, stop_token_ids=[target]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
    short = llm.generate([PROMPT], greedy(max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_eos_stops_unless_ignored(llm) -> None:
    """Find a prompt whose greedy continuation emits EOS, then ignore it."""
    prompts = random_prompts(40, seed=41)
    outs = llm.generate(prompts, greedy(max_tokens=30), use_tqdm=False)
    stopped = [i for i, o in enumerate(outs) if o.finish_reason == "stop"]
    assert stopped, "no prompt produced EOS; pick another seed"
    prompt, out = prompts[stopped[0]], outs[stopped[0]]
    assert out.token_ids[-1] == EOS
    ignored = llm.generate([prompt], greedy(max_tokens=30, ignore_eos=True), use_tqdm=False)[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == 30
    assert ignored.token_ids[: len(out.token_ids)] == out.token_ids


def test_max_model_len_ends_with_length(qwen3) -> None:
    llm = LLM(qwen3[0], dtype="float32", max_model_len=20)
    out = llm.generate([[5] * 15], greedy(max_tokens=50, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
