"""The server renders chat templates as transformers does, without transformers:
on the shipped model's template and on a ChatML-style one with loops, filters and
raised errors; and the sandbox keeps a template out of Python's internals."""

from __future__ import annotations

import os

import pytest
from jinja2 import TemplateError
from jinja2.exceptions import SecurityError

from engine.entrypoints.chat_template import ChatTemplate, load_chat_template
from tests.server.conftest import TINY

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ bos_token }}<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('bad role') }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ messages | length | tojson }}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "What is a block?"}],
    [
        {"role": "system", "content": "Answer in one line."},
        {"role": "user", "content": "  Who frees blocks? "},
        {"role": "assistant", "content": "The block manager."},
        {"role": "user", "content": "naïve café — 東京 😀"},
    ],
]


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TINY, local_files_only=True)


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("source", ["shipped", "chatml"])
def test_renders_as_transformers_does(hf_tokenizer, source, generation_prompt) -> None:
    ours = load_chat_template(TINY)
    if source == "chatml":
        ours = ChatTemplate(CHATML, ours.special_tokens)
        hf_tokenizer.chat_template = CHATML
    for messages in CONVERSATIONS:
        expected = hf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        assert ours.render(messages, generation_prompt) == expected


def test_a_refused_conversation_raises_a_template_error() -> None:
    with pytest.raises(TemplateError, match="unknown role"):
        load_chat_template(TINY).render([{"role": "tool", "content": "x"}])


def test_the_sandbox_keeps_templates_out_of_python() -> None:
    escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(SecurityError):
        ChatTemplate(escape, {}).render([])
    mutate = "{% set _ = messages.append({'role': 'user'}) %}"
    with pytest.raises(SecurityError):
        ChatTemplate(mutate, {}).render([{"role": "user", "content": "hi"}])
