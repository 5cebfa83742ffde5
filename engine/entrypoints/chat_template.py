"""Chat templates: a checkpoint's own recipe for turning a conversation into one
prompt, rendered as transformers renders it (a sandboxed jinja2 environment with
the same options and helpers), without importing transformers.

The template comes from the model folder: `chat_template.jinja`, as transformers
5 saves it, or the `chat_template` entry of tokenizer_config.json.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


class ChatTemplate:
    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        # The options transformers uses: a template cannot reach Python's internals,
        # nor change the objects it is given.
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(source)
        self.special_tokens = special_tokens

    def render(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
    ) -> str:
        """The prompt; a conversation the template refuses raises TemplateError.
        ``tools``: OpenAI's tool definitions, for a template that lists them."""
        return self.template.render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **self.special_tokens,
        )


def load_chat_template(model: Path) -> ChatTemplate | None:
    """The folder's chat template, or None if it has none."""
    config_file = model / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    jinja_file = model / "chat_template.jinja"
    source = jinja_file.read_text() if jinja_file.is_file() else config.get("chat_template")
    if isinstance(source, list):  # several named templates: take the default
        source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not source:
        return None
    special = {}
    for name in SPECIAL_TOKENS:
        token = config.get(name)
        if isinstance(token, dict):  # an AddedToken, saved with its options
            token = token.get("content")
        if isinstance(token, str):
            special[name] = token
    return ChatTemplate(source, special)
