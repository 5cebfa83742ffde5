"""A token as logprobs show it: its text, its own bytes, and a key for
completions' top_logprobs that no other token of the same position shares.

Decoding one token of a byte-level vocabulary is lossy: a token that holds part
of a character (one byte of a three-byte "€") decodes to "\\ufffd", and so does
every other such token. The bytes come from the vocabulary instead: a byte-level
BPE token's string spells its bytes one character each (GPT-2's bytes_to_unicode
table), and a byte-fallback token is spelled ``<0xNN>``.
"""

from __future__ import annotations

import re
from functools import lru_cache

from tokenizers import Tokenizer, decoders

_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2's table inverted: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = isinstance(tokenizer.decoder, decoders.ByteLevel)
        self.special = {t.content for t in tokenizer.get_added_tokens_decoder().values()}

    def text(self, token_id: int) -> str:
        """The token decoded alone, as vLLM shows it ("\\ufffd" for part of a character)."""
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> bytes:
        """The token's own bytes, even where they are not a whole character."""
        piece = self.tokenizer.id_to_token(token_id)
        if piece is None or piece in self.special:
            return self.text(token_id).encode()
        if (m := _BYTE_FALLBACK.fullmatch(piece)) is not None:
            return bytes([int(m.group(1), 16)])
        table = byte_decoder()
        if self.byte_level and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        text = self.text(token_id)
        return piece.replace("\u2581", " ").encode() if "\ufffd" in text else text.encode()

    def top_keys(self, token_ids: list[int]) -> list[str]:
        """Keys for completions' top_logprobs, one per token: its text, as vLLM
        keys them; where an earlier token took that text, the token's vocabulary
        string (Ġ for a space, as in GPT-2), and failing that vLLM's
        ``token_id:N``, so that n tokens give n keys."""
        keys: list[str] = []
        for t in token_ids:
            key = self.text(t)
            if key in keys:
                key = self.tokenizer.id_to_token(t) or key
            if key in keys:
                key = f"token_id:{t}"
            keys.append(key)
        return keys
