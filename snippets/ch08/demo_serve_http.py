"""Demo: `deepinfer serve` answers plain HTTP, the requests curl sends: a
completion, whole, and a chat reply streamed as server-sent events.

The demo starts the server on a free port, sends the two requests with Python's
own urllib, and stops the server. Fields that differ on every call (the
response's id and its creation time) are left out of what it prints.
"""

from __future__ import annotations

import json
import os
import urllib.request

from engine.tools.launch import launched

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
NAME = os.path.basename(MODEL)  # the name the server serves the model under
VARYING = ("id", "created")
COMPLETIONS, CHAT_COMPLETIONS = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": NAME, "prompt": "def free(self", "max_tokens": 6, "temperature": 0}
CHAT = {
    "model": NAME,
    "messages": [{"role": "user", "content": "What is a block?"}],
    "max_tokens": 4,
    "temperature": 0,
    "stream": True,
}


def post(url: str, path: str, body: dict) -> str:
    request = urllib.request.Request(
        url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as reply:
        return reply.read().decode()


def main() -> dict:
    with launched("serve", MODEL, "--dtype", "float32") as url:
        whole = json.loads(post(url, COMPLETIONS, COMPLETION))
        events = post(url, CHAT_COMPLETIONS, CHAT).split("\n\n")
    for key in VARYING:
        whole.pop(key)
    print(f"POST {COMPLETIONS}")
    print(json.dumps(whole, indent=1))
    print()
    print(f"POST {CHAT_COMPLETIONS} (stream): each event's")
    print("choice, compact, after its 'data: '")
    for event in filter(None, events):
        data = event.removeprefix("data: ")
        if data == "[DONE]":
            print(f"  {data}")
            continue
        (choice,) = json.loads(data)["choices"]
        del choice["index"]
        print(f"  {json.dumps(choice, separators=(',', ':'))}")
    usage = whole["usage"]
    return {
        "completion_text": whole["choices"][0]["text"],
        "completion_tokens": usage["completion_tokens"],
        "prompt_tokens": usage["prompt_tokens"],
        "events": sum(1 for e in events if e.startswith("data: ")),
    }


if __name__ == "__main__":
    main()
