"""Prompt text to token ids without stalling the server.

Tokenizing a few megabytes takes seconds, and `Tokenizer.encode` holds the GIL
all that time: on the event loop it would freeze every stream and /health. So
text is tokenized in a thread, with `encode_batch`, which releases the GIL; and
a prompt that cannot fit in the context is refused before any of it is
tokenized, from a lower bound on its token count that costs one pass over its
bytes.

The bound: every token stands for at most `longest` bytes of the text the
tokenizer's model sees, where `longest` is the longest token in the vocabulary,
in UTF-8 bytes. If nothing before the model drops text, a prompt of B bytes is
at least ceil(B / longest) tokens. Unicode normalizers can shrink text by at
most a factor of three (three Hangul jamo compose to one syllable, a Kelvin
sign lowercases to "k"), so they divide the bound by three; a normalizer or
pre-tokenizer that may drop text (strip, replace, whitespace splitting) turns
the bound off, and such a prompt is tokenized in full.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from tokenizers import Tokenizer

from engine.entrypoints.errors import bad_request
from engine.utils import cdiv

# Normalizers that rewrite text without dropping any of it, and by how much they
# can shrink it at most.
SHRINK = {"NFC": 3, "NFD": 3, "NFKC": 3, "NFKD": 3, "Lowercase": 3, "Precompiled": 3, "Prepend": 1}
KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split"}
INLINE_BYTES = 16 * 1024  # shorter text is tokenized in the loop: a thread hop costs more


def _shrink(normalizer: dict | None) -> int:
    """The most a normalizer can shrink text by; 0 if it may drop text."""
    if normalizer is None:
        return 1
    if normalizer["type"] == "Sequence":
        factor = 1
        for part in normalizer["normalizers"]:
            factor *= _shrink(part)
        return factor
    return SHRINK.get(normalizer["type"], 0)


def _keeps_text(pre: dict | None) -> bool:
    if pre is None:
        return True
    if pre["type"] == "Sequence":
        return all(_keeps_text(p) for p in pre["pretokenizers"])
    return pre["type"] in KEEPS_TEXT and pre.get("behavior") != "Removed"


def bytes_per_token(tokenizer: Tokenizer) -> int | None:
    """The most UTF-8 bytes of prompt one token can stand for; None if unbounded."""
    spec = json.loads(tokenizer.to_str())
    shrink = _shrink(spec.get("normalizer"))
    if shrink == 0 or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    longest = max(len(token.encode()) for token in tokenizer.get_vocab(with_added_tokens=True))
    return longest * shrink


class PromptTokenizer:
    def __init__(self, tokenizer: Tokenizer | None, max_model_len: int, threads: int = 2) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.bytes_per_token = bytes_per_token(tokenizer) if tokenizer is not None else None
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")

    def at_least(self, text: str) -> int:
        """A lower bound on the prompt's token count (0 when none can be given)."""
        return self._at_least(len(text.encode()))

    def _at_least(self, size: int) -> int:
        """The bound for a prompt of ``size`` UTF-8 bytes."""
        return 0 if self.bytes_per_token is None else cdiv(size, self.bytes_per_token)

    async def encode(
        self,
        text: str | list[int],
        param: str = "prompt",
        add_special_tokens: bool = True,
        bounded: bool = True,
    ) -> list[int]:
        """The prompt's token ids, in the pool's threads beyond INLINE_BYTES. With
        ``bounded``, a prompt that cannot fit the context is a 400 before it is
        tokenized; /tokenize counts text of any length (bounded=False)."""
        if isinstance(text, list):
            return text
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer; send token ids", param)
        try:
            size = len(text.encode())
        except UnicodeEncodeError:  # valid JSON ("\ud800"), but no text
            raise bad_request(
                f"{param}: a lone surrogate is not valid Unicode text", param
            ) from None
        if bounded and (least := self._at_least(size)) >= self.max_model_len:  # encoded once
            raise bad_request(
                f"the prompt has at least {least} tokens ({size} bytes), but this model's "
                f"maximum context length is {self.max_model_len} tokens",
                param,
            )
        if size <= INLINE_BYTES:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        loop = asyncio.get_running_loop()
        released = partial(self._encode_released, text, add_special_tokens)
        return await loop.run_in_executor(self.pool, released)

    def _encode_released(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch lets the GIL go
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
