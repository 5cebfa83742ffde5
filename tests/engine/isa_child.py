"""One cell of the ISA-by-mode matrix (test_isa_matrix.py), in a process of its own:
load a model with the engine options given as JSON, generate greedily for one
prompt, and print the token ids as JSON on the last line of stdout.

    python -m tests.engine.isa_child MODEL '{"dtype": "float32", "compile_decode": true}'

The parent runs it under other CPU capabilities and with glibc's heap checks on,
so that a crash, or a corruption that glibc notices, fails the cell."""

from __future__ import annotations

import json
import sys

PROMPT = [5, 17, 99, 240, 31, 8, 77, 12]
MAX_TOKENS = 4


def main(model: str, options: str) -> None:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model, **json.loads(options))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    llm.shutdown()
    print(json.dumps(out.token_ids), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
