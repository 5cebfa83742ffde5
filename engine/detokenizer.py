"""Turning generated tokens into text one token at a time, and finding stop
strings that may span several tokens."""

from __future__ import annotations

from tokenizers import Tokenizer

from engine.sequence import Sequence

# Decode a few prompt tokens ahead of the output, so the first output token is
# spelled as it would be mid-sentence (leading spaces and merged bytes).
CONTEXT_TOKENS = 5


def start_detokenizer(seq: Sequence) -> None:
    seq.detok_read_offset = seq.num_prompt_tokens
    seq.detok_prefix_offset = max(seq.num_prompt_tokens - CONTEXT_TOKENS, 0)


def detokenize_incrementally(tokenizer: Tokenizer, seq: Sequence) -> str:
    """The text the newest token adds, or "" while it is an incomplete character.

    Decoding a token alone is wrong for byte-level vocabularies: one character
    can take several tokens, and a space can belong to the next token. So we
    decode a short window twice, with and without the new tokens, and emit the
    difference once it no longer ends in a half-built character.
    """
    ids = seq.token_ids
    before = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset])
    after = tokenizer.decode(ids[seq.detok_prefix_offset :])
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    seq.detok_prefix_offset, seq.detok_read_offset = seq.detok_read_offset, len(ids)
    return after[len(before) :]


def flush_detokenizer(tokenizer: Tokenizer, seq: Sequence) -> str:
    """At the end, whatever the window still holds back, even a broken character,
    so that the text equals decoding all the output tokens at once."""
    ids = seq.token_ids
    before = tokenizer.decode(ids[seq.detok_prefix_offset : seq.detok_read_offset])
    after = tokenizer.decode(ids[seq.detok_prefix_offset :])
    seq.detok_prefix_offset = seq.detok_read_offset = len(ids)
    return after[len(before) :]


def find_stop_string(seq: Sequence, new_text: str) -> bool:
    """Cut ``seq.text`` at the first stop string that the new text completes.

    Only the tail can hold a new match: the new characters plus enough of the
    old ones for a stop string that started in an earlier token.
    """
    stops = seq.params.stop
    if not stops or not new_text:
        return False
    longest = max(len(s) for s in stops)
    tail_start = max(0, len(seq.text) - len(new_text) - longest + 1)
    hits = [i for s in stops if (i := seq.text.find(s, tail_start)) != -1]
    if not hits:
        return False
    seq.text = seq.text[: min(hits)]
    return True


def visible_text(seq: Sequence) -> str:
    """What a stream may show so far: hold back a tail that could still turn out
    to be the start of a stop string."""
    if seq.is_finished or not seq.params.stop:
        return seq.text
    hold = max(len(s) for s in seq.params.stop) - 1
    return seq.text[: max(0, len(seq.text) - hold)]
