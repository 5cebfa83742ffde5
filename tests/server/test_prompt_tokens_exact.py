"""The prompt tokenizer's bound and refusals pinned to exact values (issue 49):
each normalizer's shrink factor and each pre-tokenizer's verdict, the bound at
its boundaries, the refusal's words, which text is tokenized inline and which
in a thread, and the special tokens on either path. test_big_prompts.py checks
the bound against real token counts and the loop's pauses."""

from __future__ import annotations

import asyncio
import threading

import pytest
from tokenizers import Tokenizer
from tokenizers.processors import TemplateProcessing

from engine.entrypoints.errors import OpenAIError
from engine.entrypoints.prompt_tokens import (
    INLINE_BYTES,
    KEEPS_TEXT,
    SHRINK,
    PromptTokenizer,
    _keeps_text,
    _shrink,
    bytes_per_token,
)
from tests.server.test_big_prompts import TOKENIZER


def test_the_tables() -> None:
    assert SHRINK == {
        "NFC": 3, "NFD": 3, "NFKC": 3, "NFKD": 3, "Lowercase": 3, "Precompiled": 3, "Prepend": 1
    }  # fmt: skip
    assert {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"} == (
        KEEPS_TEXT
    )
    assert INLINE_BYTES == 16384


def test_each_normalizer_shrinks_text_by_its_factor_and_a_sequence_by_their_product() -> None:
    assert _shrink(None) == 1
    assert _shrink({"type": "NFKC"}) == 3 and _shrink({"type": "Prepend", "prepend": "_"}) == 1
    assert _shrink({"type": "Strip"}) == 0 and _shrink({"type": "Replace"}) == 0
    seq = {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Prepend"}]}
    assert _shrink(seq) == 3
    seq = {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Lowercase"}]}
    assert _shrink(seq) == 9
    seq = {"type": "Sequence", "normalizers": [{"type": "NFD"}, {"type": "Strip"}]}
    assert _shrink(seq) == 0
    assert _shrink({"type": "Sequence", "normalizers": []}) == 1


def test_each_pre_tokenizer_keeps_text_or_not() -> None:
    assert _keeps_text(None)
    assert _keeps_text({"type": "ByteLevel"}) and _keeps_text(
        {"type": "Split", "behavior": "Isolated"}
    )
    assert not _keeps_text({"type": "Split", "behavior": "Removed"})
    assert not _keeps_text({"type": "Whitespace"})
    keep = {"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "Metaspace"}]}
    assert _keeps_text(keep)
    drop = {"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "Whitespace"}]}
    assert not _keeps_text(drop)


def test_the_tiny_tokenizers_longest_token_is_its_bound() -> None:
    longest = max(len(t.encode()) for t in TOKENIZER.get_vocab(with_added_tokens=True))
    assert bytes_per_token(TOKENIZER) == longest == 78


def test_the_bound_at_its_edges() -> None:
    prompts = PromptTokenizer(TOKENIZER, max_model_len=3)
    assert prompts.bytes_per_token == 78
    assert [prompts.at_least("a" * n) for n in (0, 1, 78, 79, 156, 157)] == [0, 1, 1, 2, 2, 3]
    assert prompts.at_least("é" * 39) == 1 and prompts.at_least("é" * 40) == 2  # two bytes each
    assert PromptTokenizer(None, 3).bytes_per_token is None
    assert PromptTokenizer(None, 3).at_least("a" * 1000) == 0


def test_a_prompt_that_cannot_fit_is_refused_in_words_before_it_is_tokenized() -> None:
    prompts = PromptTokenizer(TOKENIZER, max_model_len=3)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(prompts.encode("a" * 157, param="input"))
    assert (err.value.status, err.value.param) == (400, "input")
    assert err.value.message == (
        "the prompt has at least 3 tokens (157 bytes), but this model's maximum context "
        "length is 3 tokens"
    )
    ids = asyncio.run(prompts.encode("a" * 156))  # at least 2: it is tokenized
    assert ids == TOKENIZER.encode("a" * 156).ids
    assert len(asyncio.run(prompts.encode("a" * 157, bounded=False))) > 3  # /tokenize's count
    assert asyncio.run(prompts.encode([1, 2, 3, 4])) == [1, 2, 3, 4]  # ids pass as they are


def test_text_without_a_tokenizer_or_not_unicode_is_refused_by_name() -> None:
    with pytest.raises(OpenAIError) as err:
        asyncio.run(PromptTokenizer(None, 8).encode("hi", param="messages"))
    assert err.value.message == "this model has no tokenizer; send token ids"
    assert (err.value.status, err.value.param) == (400, "messages")
    with pytest.raises(OpenAIError) as err:
        asyncio.run(PromptTokenizer(TOKENIZER, 8).encode("a\ud800", param="input"))
    assert err.value.message == "input: a lone surrogate is not valid Unicode text"
    assert (err.value.status, err.value.param) == (400, "input")


def with_bos() -> Tokenizer:
    tok = Tokenizer.from_str(TOKENIZER.to_str())
    tok.post_processor = TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]
    )
    return tok


@pytest.mark.parametrize("size", [INLINE_BYTES, INLINE_BYTES + 1])
def test_text_up_to_inline_bytes_is_tokenized_in_the_loop_and_longer_in_a_thread(
    size: int, monkeypatch
) -> None:
    tok = with_bos()
    prompts = PromptTokenizer(tok, max_model_len=10**9)
    threads: list[str] = []
    encode_batch = Tokenizer.encode_batch

    class Watched:
        def __getattr__(self, name):
            return getattr(tok, name)

        def encode(self, *args, **kw):
            threads.append(threading.current_thread().name)
            return tok.encode(*args, **kw)

        def encode_batch(self, *args, **kw):
            threads.append(threading.current_thread().name)
            return encode_batch(tok, *args, **kw)

    prompts.tokenizer = Watched()
    text = "a" * size
    plain = tok.encode(text, add_special_tokens=False).ids
    assert asyncio.run(prompts.encode(text)) == [0, *plain]
    assert asyncio.run(prompts.encode(text, add_special_tokens=False)) == plain
    inline = size <= INLINE_BYTES
    assert all(name.startswith("tokenize") != inline for name in threads), threads
    assert len(threads) == 2
    prompts.close()
    assert prompts.pool._shutdown


def test_the_pool_has_the_threads_asked_for() -> None:
    assert PromptTokenizer(TOKENIZER, 8).pool._max_workers == 2
    assert PromptTokenizer(TOKENIZER, 8, threads=3).pool._max_workers == 3


def test_a_refusal_names_the_prompt_by_default() -> None:
    with pytest.raises(OpenAIError) as err:
        asyncio.run(PromptTokenizer(None, 8).encode("hi"))
    assert err.value.param == "prompt"


def test_closing_cancels_what_waits_and_does_not_wait_for_what_runs() -> None:
    prompts = PromptTokenizer(TOKENIZER, 8, threads=1)
    release = threading.Event()
    running = prompts.pool.submit(release.wait, 30)
    waiting = prompts.pool.submit(int, "1")
    closer = threading.Thread(target=prompts.close)
    closer.start()
    closer.join(5)
    try:
        assert not closer.is_alive()  # it did not wait for the running one
        assert waiting.cancelled() and not running.done()
    finally:
        release.set()
    assert running.result(5) is True


def test_an_added_token_longer_than_the_vocabularys_sets_the_bound() -> None:
    tok = Tokenizer.from_str(TOKENIZER.to_str())
    tok.add_special_tokens(["<|" + "x" * 96 + "|>"])  # 100 bytes, more than any other
    assert bytes_per_token(tok) == 100
