"""Demo: an invalid grammar gets its clear error; the other requests finish.

Three requests are queued, one of them constrained by a regular expression.
Then a fourth arrives with an EBNF grammar that refers to a rule it never
defines: add_request raises ValueError with xgrammar's message, before
anything in the engine changes, and the engine serves the other three.
"""

from __future__ import annotations

import os
import textwrap

from engine import LLM, SamplingParams, StructuredOutputsParams

MODEL = os.environ.get("DEEPINFER_DEMO_MODEL", "snippets/models/deepinfer-tiny")
BAD_GRAMMAR = 'root ::= "step " number'  # `number` is never defined
REGEX = r"(prefill|decode) [0-9]{1,3} tokens"


def main() -> dict:
    engine = LLM(MODEL, dtype="float32", num_kv_blocks=64).llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=8)
    engine.add_request("a", "The block manager", greedy)
    engine.add_request("b", "def step(self):", greedy)
    regex = StructuredOutputsParams(regex=REGEX)
    engine.add_request("c", "A step is", SamplingParams(seed=3, structured_outputs=regex))
    try:
        bad = StructuredOutputsParams(grammar=BAD_GRAMMAR)
        engine.add_request("d", "A step is", SamplingParams(structured_outputs=bad))
        error = ""
    except ValueError as e:
        error = str(e)
    print("add_request('d') raised ValueError:")
    for line in textwrap.wrap(error, 52):
        print(f"  {line}")
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    print()
    for name, out in sorted(finished.items()):
        print(f"{name}: {out.finish_reason:<6} {out.text[:40]!r}")
    print(f"finished: {len(finished)}, 'd' known: {'d' in engine.requests}")
    return {
        "error": error,
        "finished": len(finished),
        "regex_text": finished["c"].text,
        "d_known": "d" in engine.requests,
    }


if __name__ == "__main__":
    main()
