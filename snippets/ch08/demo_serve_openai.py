"""Demo: the official openai client, unchanged, talks to `deepinfer serve`: a
chat reply, a seeded sample that repeats, a stream, and a second request that
finds its prompt's blocks in the prefix cache."""

from __future__ import annotations

import os

from openai import OpenAI

from engine.tools.launch import launched

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
NAME = os.path.basename(MODEL)
SEED = 7
WIDTH = 56  # a phone's output box
SYSTEM = (
    "You answer questions about DeepInfer, a small inference engine. The scheduler "
    "decides which sequences run each step; the block manager owns the KV cache."
)
MESSAGES = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is a block?"},
]


def rows(pieces) -> list[str]:
    """The pieces, " | " between them, on lines that fit a phone."""
    lines = [""]
    for piece in pieces:
        if lines[-1] and len(lines[-1]) + len(piece) + 3 > WIDTH - 2:
            lines.append("")
        lines[-1] += f" | {piece}" if lines[-1] else piece
    return ["  " + line for line in lines]


def main() -> dict:
    with launched("serve", MODEL, "--dtype", "float32") as url:
        client = OpenAI(base_url=url + "/v1", api_key="none")  # no --api-key: any will do
        chat = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0
        )
        sample = dict(model=NAME, prompt="The KV cache", max_tokens=8, temperature=0.8)
        draws = [client.completions.create(**sample, seed=SEED).choices[0].text for _ in "ab"]
        stream = client.completions.create(**sample, seed=SEED, stream=True)
        pieces = [chunk.choices[0].text for chunk in stream]
        again = client.chat.completions.create(
            model=NAME, messages=MESSAGES, max_completion_tokens=8, temperature=0
        )
    reply, usage = chat.choices[0], chat.usage
    cached = again.usage.prompt_tokens_details.cached_tokens
    print(f"chat reply: {reply.message.content!r}")
    print(f"  finish_reason {reply.finish_reason}, {usage.prompt_tokens} prompt tokens,")
    print(f"  {usage.completion_tokens} completion tokens")
    print(f"sampled twice with seed {SEED}:")
    for text in draws:
        print(f"  {text!r}")
    print("streamed, piece by piece:")
    for line in rows(map(repr, pieces)):
        print(line)
    print(f"the same chat again: {cached} of its {again.usage.prompt_tokens}")
    print("  prompt tokens found in the prefix cache")
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "same_draws": draws[0] == draws[1],
        "stream_equals_draw": "".join(pieces) == draws[0],
        "cached_tokens": cached,
        "cached_first": usage.prompt_tokens_details.cached_tokens,
    }


if __name__ == "__main__":
    main()
