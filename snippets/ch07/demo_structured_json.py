"""Demo: deepinfer-tiny, constrained by a JSON schema, writes JSON that parses.

The same seeded requests run twice: with the schema, and without it. The demo
parses every output and checks it against the schema, and shows how many
tokens the grammar allowed at each step of one request.
"""

from __future__ import annotations

import json
import os

from engine import LLM, SamplingParams, StructuredOutputsParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
PROMPT = "The scheduler"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "blocks": {"type": "integer"},
        "cached": {"type": "boolean"},
    },
    "required": ["name", "blocks", "cached"],
}
SEEDS = 8
MAX_TOKENS = 48
SHOWN_STEPS = 6
WIDTH = 40  # characters of free text shown


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    props = SCHEMA["properties"]
    return (
        set(value) == set(props)
        and len(value["name"]) <= props["name"]["maxLength"]
        and type(value["blocks"]) is int
        and type(value["cached"]) is bool
    )


def allowed_per_step(llm: LLM, spec: StructuredOutputsParams, tokens: list[int]) -> list[int]:
    """How many tokens the grammar allowed before each of ``tokens``."""
    manager = llm.llm_engine.structured_output
    req = manager.request_for(spec)
    counts = []
    for token in tokens:
        bitmask = manager.empty_bitmask(1)
        req.fill_bitmask(bitmask, 0)
        counts.append(sum(bin(w & 0xFFFFFFFF).count("1") for w in bitmask[0].tolist()))
        req.accept(token)
    return counts


def main() -> dict:
    llm = LLM(MODEL, dtype="float32", num_kv_blocks=64)
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

    def run(structured: StructuredOutputsParams | None) -> list:
        params = [
            SamplingParams(seed=s, max_tokens=MAX_TOKENS, structured_outputs=structured)
            for s in range(SEEDS)
        ]
        return llm.generate([PROMPT] * SEEDS, params, use_tqdm=False)

    constrained, free = run(spec), run(None)
    print(f"{SEEDS} seeded samples of {PROMPT!r}, with the schema")
    print("(parsed, and printed again without spaces):")
    for out in constrained[:3]:
        print(f"  {json.dumps(json.loads(out.text), separators=(',', ':'))}")
    print("  ...")
    print("the same seeds without it:")
    print(f"  {free[0].text[:WIDTH]!r}")
    ok = sum(valid(o.text) for o in constrained)
    ok_free = sum(valid(o.text) for o in free)
    print()
    print(f"valid against the schema: {ok} of {SEEDS} with it,")
    print(f"  {ok_free} of {SEEDS} without it")
    stopped = sum(o.finish_reason == "stop" for o in constrained)
    stopped_free = sum(o.finish_reason == "stop" for o in free)
    for label, outs in (("with the schema", constrained), ("without it", free)):
        reasons = [o.finish_reason for o in outs]
        counts = ", ".join(f"{r} {reasons.count(r)}" for r in ("stop", "length"))
        print(f"finish reasons {label}: {counts}")
    counts = allowed_per_step(llm, spec, constrained[0].token_ids)
    vocab = llm.llm_engine.structured_output.vocab_size
    print(f"tokens allowed (of {vocab}) at the first steps:")
    print("  " + " ".join(map(str, counts[:SHOWN_STEPS])))
    print(f"  at most, inside a string: {max(counts)}")
    return {
        "seeds": SEEDS,
        "valid_constrained": ok,
        "valid_free": ok_free,
        "first_text": constrained[0].text,
        "vocab": vocab,
        "allowed_first_steps": counts[:SHOWN_STEPS],
        "allowed_first": counts[0],
        "allowed_most": max(counts),
        "finished_by_grammar": stopped,
        "stopped_free": stopped_free,
        "max_tokens": MAX_TOKENS,
    }


if __name__ == "__main__":
    main()
