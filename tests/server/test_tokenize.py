"""vLLM's tokenizer endpoints on `deepinfer serve`: /tokenize gives the ids the
completions and chat endpoints feed the engine, /detokenize turns them back
into the text, /tokenizer_info describes the tokenizer from its checkpoint."""

from __future__ import annotations

import json

import httpx
from tokenizers import Tokenizer

from engine.entrypoints.chat_template import load_chat_template
from tests.server.conftest import TINY, auth

MODEL = "deepinfer-tiny"
TEXT = "The quick brown fox<|endoftext|> jumps over 13 lazy dogs."
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is two plus two?"},
]


def post(url: str, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, headers=headers, timeout=60)


def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TINY / "tokenizer.json"))


def prompt_tokens(url: str, path: str, body: dict) -> int:
    """usage.prompt_tokens of a one-token completion or chat completion."""
    reply = post(url, path, {**body, "max_tokens": 1}, headers=auth())
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["prompt_tokens"]


def test_tokenize_gives_the_ids_a_completion_feeds_the_engine(server) -> None:
    reply = post(server.url, "/tokenize", {"prompt": TEXT})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["tokens"] == tokenizer().encode(TEXT).ids
    assert body["tokens"].count(0) == 1  # <|endoftext|> is one special token, not its letters
    assert (
        body["count"]
        == len(body["tokens"])
        == prompt_tokens(server.url, "/v1/completions", {"prompt": TEXT})
    )
    assert body["max_model_len"] == 128  # the session server's --max-model-len
    assert body["token_strs"] is None
    plain = post(server.url, "/tokenize", {"prompt": TEXT, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer().encode(TEXT, add_special_tokens=False).ids


def test_tokenize_gives_each_tokens_vocabulary_string_when_asked(server) -> None:
    body = post(server.url, "/tokenize", {"prompt": TEXT, "return_token_strs": True}).json()
    vocab = tokenizer()
    assert body["token_strs"] == [vocab.id_to_token(t) for t in body["tokens"]]
    assert any(s.startswith("Ġ") for s in body["token_strs"])  # GPT-2's space, not its text


def test_tokenize_counts_text_longer_than_the_context(server) -> None:
    """A client splits a long document by its tokens: /tokenize takes it whole,
    where a completion of it is refused."""
    text = " ".join(["word"] * 300)
    body = post(server.url, "/tokenize", {"prompt": text}).json()
    assert body["tokens"] == tokenizer().encode(text).ids
    assert body["count"] > body["max_model_len"]
    refused = post(server.url, "/v1/completions", {"prompt": text, "max_tokens": 1}, auth())
    assert refused.status_code == 400


def test_tokenize_of_messages_gives_the_ids_a_chat_feeds_the_engine(server) -> None:
    template = load_chat_template(TINY)
    for generation_prompt in (True, False):
        request = {"messages": MESSAGES, "add_generation_prompt": generation_prompt}
        reply = post(server.url, "/tokenize", request)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        rendered = template.render(MESSAGES, generation_prompt)
        assert body["tokens"] == tokenizer().encode(rendered, add_special_tokens=False).ids
        assert body["count"] == prompt_tokens(server.url, "/v1/chat/completions", request)
    with_prompt = post(server.url, "/tokenize", {"messages": MESSAGES}).json()
    assert tokenizer().decode(with_prompt["tokens"]).endswith("A:")  # the default: True


def test_detokenize_round_trips_tokenize(server) -> None:
    ids = post(server.url, "/tokenize", {"prompt": TEXT}).json()["tokens"]
    reply = post(server.url, "/detokenize", {"tokens": ids})
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"prompt": TEXT}  # the special token's text kept


def test_detokenize_refuses_ids_outside_the_vocabulary(server) -> None:
    size = tokenizer().get_vocab_size(with_added_tokens=True)
    for bad in (size, -1, 2**70):
        reply = post(server.url, "/detokenize", {"tokens": [1, bad]})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == "tokens"
        assert str(bad) in error["message"]


def test_tokenizer_info_describes_the_checkpoints_tokenizer(server) -> None:
    reply = httpx.get(server.url + "/tokenizer_info", timeout=60)
    assert reply.status_code == 200, reply.text
    info = reply.json()
    saved = json.loads((TINY / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == saved["tokenizer_class"] == "PreTrainedTokenizerFast"
    models = httpx.get(server.url + "/v1/models", headers=auth(), timeout=60).json()
    assert info["model_max_length"] == models["data"][0]["max_model_len"] == 128
    for name in ("bos_token", "eos_token", "pad_token"):
        assert info[name] == saved[name] == "<|endoftext|>"
    assert "unk_token" not in info  # the checkpoint has none
    assert info["chat_template"] == saved["chat_template"]
    assert info["clean_up_tokenization_spaces"] is False  # the rest of the config, as vLLM


def test_an_unknown_model_is_a_404(server) -> None:
    for path, body in (
        ("/tokenize", {"prompt": TEXT}),
        ("/tokenize", {"messages": MESSAGES}),
        ("/detokenize", {"tokens": [1, 2]}),
    ):
        reply = post(server.url, path, {**body, "model": "no-such-model"})
        assert reply.status_code == 404, reply.text
        assert reply.json()["error"]["code"] == "model_not_found"


def test_the_api_key_guards_v1_only_as_in_vllm(server) -> None:
    assert httpx.get(server.url + "/v1/models", timeout=60).status_code == 401
    assert post(server.url, "/tokenize", {"prompt": TEXT}).status_code == 200
    assert post(server.url, "/tokenize", {"prompt": TEXT}, auth()).status_code == 200


def test_tokenize_takes_a_prompt_or_messages_not_both(server) -> None:
    for body in ({}, {"prompt": TEXT, "messages": MESSAGES}):
        reply = post(server.url, "/tokenize", body)
        assert reply.status_code == 400, reply.text
        assert "either prompt or messages" in reply.json()["error"]["message"]
    reply = post(server.url, "/tokenize", {"prompt": 3})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
