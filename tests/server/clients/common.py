"""What the client tests compare against: the server's own reply to the same
request, sent with httpx."""

from __future__ import annotations

import httpx

from tests.server.clients.conftest import MODEL, ORACLE

QUESTION = "What is a block?"


def chat_text(url: str, max_tokens: int, **extra) -> tuple[str, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}]}
    body |= {"max_tokens": max_tokens, "temperature": 0, **extra}
    reply = httpx.post(url + "/v1/chat/completions", json=body, headers=ORACLE, timeout=120)
    reply = reply.json()
    choice = reply["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def completion_text(url: str, prompt: str, max_tokens: int) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    reply = httpx.post(url + "/v1/completions", json=body, headers=ORACLE, timeout=120)
    return reply.json()["choices"][0]["text"]
