"""The sampling fields through the official openai client, each honoured, not
just accepted: logit_bias, min_tokens, the penalties, include_stop_str_in_output
and echo; and the logprobs of byte-level tokens (their own bytes in chat, n
distinct top_logprobs keys in completions)."""

from __future__ import annotations

import openai
import pytest
from tokenizers import Tokenizer
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tests.server.conftest import API_KEY, TINY

MODEL = "deepinfer-tiny"
PROMPT = "def schedule(self"
BYTES_PROMPT = "# “quoted” — "  # the tiny model answers with bytes of characters


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


def greedy(client, prompt: str = PROMPT, max_tokens: int = 8, **extra):
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True, **extra.pop("extra_body", {})},
        **extra,
    )


def test_logit_bias_makes_greedy_pick_the_token(client, tok) -> None:
    token = tok.encode(" block").ids[0]
    reply = greedy(client, max_tokens=4, logit_bias={str(token): 100})
    assert reply.choices[0].text == tok.decode([token] * 4)
    for bias, needle in (({"abc": 1}, "logit_bias"), ({"999999": 1}, "999999")):
        with pytest.raises(openai.BadRequestError, match=needle):
            greedy(client, logit_bias=bias)


def test_min_tokens_holds_a_stop_token_back(client, tok) -> None:
    free = greedy(client, max_tokens=10)
    stop = tok.encode(PROMPT + free.choices[0].text).ids[len(tok.encode(PROMPT).ids)]
    early = greedy(client, max_tokens=10, extra_body={"stop_token_ids": [stop]})
    assert early.usage.completion_tokens == 1 and early.choices[0].finish_reason == "stop"
    held = greedy(client, max_tokens=10, extra_body={"stop_token_ids": [stop], "min_tokens": 5})
    assert held.usage.completion_tokens > 5


def test_penalties_change_a_repetitive_greedy_reply(client) -> None:
    free = greedy(client, max_tokens=24).choices[0].text
    for extra in (
        {"frequency_penalty": 2.0},
        {"presence_penalty": 2.0},
        {"extra_body": {"repetition_penalty": 2.0}},
    ):
        assert greedy(client, max_tokens=24, **extra).choices[0].text != free, extra
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        greedy(client, presence_penalty=2.5)


def test_include_stop_str_in_output_keeps_the_stop_string(client) -> None:
    free = greedy(client, max_tokens=10).choices[0].text
    stop = free[3:6]
    cut = free.find(stop)
    kept = greedy(
        client, max_tokens=10, stop=[stop], extra_body={"include_stop_str_in_output": True}
    )
    assert kept.choices[0].text == free[: cut + len(stop)]
    assert greedy(client, max_tokens=10, stop=[stop]).choices[0].text == free[:cut]


def test_echo_puts_the_prompt_before_the_reply(client) -> None:
    free = greedy(client, max_tokens=6).choices[0].text
    echoed = greedy(client, max_tokens=6, echo=True)
    assert echoed.choices[0].text == PROMPT + free
    streamed = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        echo=True,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == PROMPT + free
    scored = greedy(client, max_tokens=6, echo=True, logprobs=2).choices[0]
    assert scored.text == PROMPT + free  # the prompt's logprobs: tests/server/test_echo_logprobs.py
    assert scored.logprobs.token_logprobs[0] is None


def partial_tokens(tok: Tokenizer) -> dict[str, bytes]:
    """The tokens that hold part of a character (they decode to "\ufffd"): their
    vocabulary spelling -> their bytes, from GPT-2's table (transformers' copy)."""
    table = {c: b for b, c in bytes_to_unicode().items()}
    spellings = [
        tok.id_to_token(i) for i in range(tok.get_vocab_size()) if tok.decode([i]) == "\ufffd"
    ]
    return {s: bytes(table[ch] for ch in s) for s in spellings}


def test_chat_logprobs_give_each_tokens_own_bytes(client, tok) -> None:
    """The reply is made of the byte 0xE2 (logit_bias forces its token), the first
    of a three-byte character it never finishes; the logprobs stay the model's own."""
    lead = tok.token_to_id(bytes_to_unicode()[0xE2])
    reply = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": BYTES_PROMPT}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        logit_bias={str(lead): 100},
        extra_body={"ignore_eos": True},
    )
    content = reply.choices[0].logprobs.content
    assert [(c.token, c.bytes) for c in content] == [("\ufffd", [0xE2])] * 6
    partial = set(partial_tokens(tok).values())
    seen = 0
    for position in content:
        tops = [bytes(t.bytes) for t in position.top_logprobs if t.token == "\ufffd"]
        assert len(set(tops)) == len(tops)  # distinct tokens, distinct bytes
        assert len(position.top_logprobs) == 5
        for entry in position.top_logprobs:
            assert entry.bytes, entry
            if entry.token == "\ufffd":  # part of a character: its own bytes, not U+FFFD's
                seen += 1
                assert bytes(entry.bytes) in partial, entry
            else:
                assert bytes(entry.bytes).decode() == entry.token
    assert seen >= 2, "the model's top tokens hold no parts of characters: pick another prompt"
    # The reply's tokens' bytes make up its text.
    joined = b"".join(bytes(c.bytes) for c in content)
    assert joined.decode("utf-8", errors="replace") == reply.choices[0].message.content


def test_completion_top_logprobs_have_n_entries_though_tokens_decode_alike(client, tok) -> None:
    reply = greedy(client, prompt=BYTES_PROMPT, max_tokens=6, logprobs=5)
    lp = reply.choices[0].logprobs
    assert all(len(top) == 5 for top in lp.top_logprobs), lp.top_logprobs
    # Where several of the top 5 decode to "\ufffd", the first keeps that text and
    # the others are keyed by their vocabulary spelling.
    spellings = partial_tokens(tok)
    assert any("\ufffd" in top and any(k in spellings for k in top) for top in lp.top_logprobs)
    # The chosen tokens keep their decoded text, as vLLM shows them.
    assert len(lp.tokens) == 6 and "\ufffd" in lp.tokens
