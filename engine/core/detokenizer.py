"""Turning generated tokens into text one token at a time, and finding stop
strings that may span several tokens."""

from __future__ import annotations

from tokenizers import Tokenizer

# Decode a few prompt tokens ahead of the output, so the first output token is
# spelled as it would be mid-sentence (leading spaces and merged bytes).
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """One request's text, grown a token at a time and cut at its first stop string.

    As in vLLM: no stop string ends the text before ``min_tokens`` output tokens
    (one must end after the text of token ``min_tokens``), and the text is cut
    before the stop string, or after it with ``include_stop_str``; a request
    the core stopped (EOS, a stop token) shows its last token's text only with
    ``include_stop_str``.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        min_tokens: int = 0,
        include_stop_str: bool = False,
    ):
        self.tokenizer = tokenizer
        self.stop = stop
        self.min_tokens = min_tokens
        self.include_stop_str = include_stop_str
        self.num_output_tokens = 0
        self.token_ids = list(prompt_token_ids[-CONTEXT_TOKENS:])  # context, then the output
        self.prefix_offset = 0  # the decoding window is token_ids[prefix_offset:]...
        self.read_offset = len(self.token_ids)  # ...and its text up to here is emitted
        self.text = ""  # the output's text, stop string excluded

    def update(self, new_token_ids: list[int], finished: bool, stop_token: bool = False) -> bool:
        """Add the new tokens' text. True if a stop string ends the text; if the
        request finished otherwise, flush what is held back, which a stop string
        may end too. ``stop_token``: the last new token stopped the request."""
        if stop_token and not self.include_stop_str:
            new_token_ids = new_token_ids[:-1]  # its text is not shown (vLLM)
        for token in new_token_ids:
            self.token_ids.append(token)
            self.num_output_tokens += 1
            new_text = self._decode_next()
            self.text += new_text
            if self._cut_at_stop_string(new_text):
                return True
        if not finished:
            return False
        flushed = self._flush()  # may end a stop string the held-back bytes hid
        self.text += flushed
        return self._cut_at_stop_string(flushed)

    def finish_at_once(self, new_token_ids: list[int], stop_token: bool = False) -> None:
        """The whole output's text in one decode, for a request whose caller sees
        only its final text and that has no stop string to watch for: the text
        update would have grown token by token (the window before the output is
        the same), at two decodes instead of two a token."""
        assert not self.stop, "stop strings are found as the text grows: use update"
        if stop_token and not self.include_stop_str:
            new_token_ids = new_token_ids[:-1]
        self.token_ids += new_token_ids
        self.num_output_tokens += len(new_token_ids)
        self.text += self._flush()

    def _decode_next(self) -> str:
        """The text the newest token adds, or "" while it is an incomplete character.

        Decoding a token alone is wrong for byte-level vocabularies: one character
        can take several tokens, and a space can belong to the next token. So we
        decode a short window twice, with and without the new tokens, and emit the
        difference once it no longer ends in a half-built character.
        """
        ids = self.token_ids
        before = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return after[len(before) :]

    def _flush(self) -> str:
        """At the end, whatever the window still holds back, even a broken character,
        so that the text equals decoding all the output tokens at once."""
        ids = self.token_ids
        before = self.tokenizer.decode(ids[self.prefix_offset : self.read_offset])
        after = self.tokenizer.decode(ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(ids)
        return after[len(before) :]

    def _cut_at_stop_string(self, new_text: str) -> bool:
        """Cut the text at the first stop string that the new text completes.

        Only the tail can hold a new match: the new characters plus enough of the
        old ones for a stop string that started in an earlier token.
        """
        if not self.stop or not new_text or self.num_output_tokens <= self.min_tokens:
            return False
        longest = max(len(s) for s in self.stop)
        tail_start = max(0, len(self.text) - len(new_text) - longest + 1)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, tail_start)) != -1]
        if not hits:
            return False
        start, first = min(hits)
        self.text = self.text[: start + len(first) if self.include_stop_str else start]
        return True

    def visible_text(self, finished: bool) -> str:
        """What a stream may show so far: hold back a tail that could still turn out
        to be the start of a stop string."""
        if finished or not self.stop or self.include_stop_str:
            return self.text
        hold = max(len(s) for s in self.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]
