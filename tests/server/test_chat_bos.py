"""A chat template that writes bos_token itself, over a tokenizer that adds BOS
too (Llama's pair): the chat prompt starts with one BOS, not two. The template
writes the special tokens a chat wants, so the chat endpoint encodes its text
without the tokenizer's own, as vLLM does and as /tokenize counts messages."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
from tokenizers import Tokenizer

from engine.config import EngineConfig
from engine.entrypoints.api_server import ServerConfig, build_app
from tests.server.conftest import TINY, in_thread

BOS = "<|endoftext|>"
TEMPLATE = "{{ bos_token }}{% for m in messages %}Q: {{ m['content'] }}\n{% endfor %}A:"


def model_with_bos(folder: Path) -> Path:
    """deepinfer-tiny whose tokenizer prepends BOS and whose template writes it."""
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (folder / name).symlink_to(TINY / name)
    tokenizer = json.loads((TINY / "tokenizer.json").read_text())
    bos_id = Tokenizer.from_file(str(TINY / "tokenizer.json")).token_to_id(BOS)
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [
            {"SpecialToken": {"id": BOS, "type_id": 0}},
            {"Sequence": {"id": "A", "type_id": 0}},
        ],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    config = json.loads((TINY / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"chat_template": TEMPLATE}))
    return folder


def test_a_template_that_writes_bos_gets_one(tmp_path: Path) -> None:
    (tmp_path / "tiny-bos").mkdir()
    model = model_with_bos(tmp_path / "tiny-bos")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    bos_id = tok.token_to_id(BOS)
    assert tok.encode("Q").ids[0] == bos_id  # the tokenizer adds one
    messages = [{"role": "user", "content": "What is a block?"}]
    config = EngineConfig(model=str(model), dtype="float32", num_kv_blocks=64)
    with in_thread(build_app(ServerConfig(config))) as url:
        body = {"model": "tiny-bos", "messages": messages, "max_tokens": 1}
        chat = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        ids = httpx.post(url + "/tokenize", json=body, timeout=60).json()["tokens"]
    rendered = "<|endoftext|>Q: What is a block?\nA:"
    assert ids == tok.encode(rendered, add_special_tokens=False).ids
    assert ids[0] == bos_id and ids[1] != bos_id
    assert chat["usage"]["prompt_tokens"] == len(ids)
