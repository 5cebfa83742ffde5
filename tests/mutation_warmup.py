"""A pytest plugin for `make mutate` only (pyproject's [tool.mutmut]): what every
mutant's test run would otherwise import or build again, done once.

mutmut forks one worker per mutant from a server that has collected the tests.
Collection does not reach the transformers model classes the checkpoint fixtures
import lazily, the C++ op the engine loads on first use, or Inductor's probe of
the CPU's vector ISA (the compiled decode asks it; it compiles test programs).
Nor does it warm what a first generate pays for once: oneDNN's kernels for the
test model's shapes, xgrammar's tokenizer tables. Together these cost a worker
some twenty seconds, more than most mutants' tests. Done here, in the server,
they are done for every fork. `make mutate` runs with OMP_NUM_THREADS=1, so the
server starts no thread pool that a fork could inherit half-held.
"""

from __future__ import annotations

import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401

import engine.csrc
from engine.compiled_decode import vector_isa

engine.csrc.load()
vector_isa()


def _generate_once() -> None:
    """One short generate on the suite's tiny Qwen3 (its fixture's weights and
    shapes): greedy, seeded with every filter and logprobs, a stop string, and
    a JSON schema."""
    import tempfile
    from pathlib import Path

    from engine import LLM, SamplingParams, StructuredOutputsParams
    from tests.engine.conftest import build_checkpoint

    path = Path(tempfile.mkdtemp()) / "qwen3"
    build_checkpoint("qwen3", path)
    hot = {"temperature": 1.0, "seed": 1, "top_k": 5, "top_p": 0.9, "min_p": 0.01}
    params = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, logprobs=2, **hot),
        SamplingParams(max_tokens=4, stop=["x"]),
        SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(json={"type": "object"})
        ),
    ]
    LLM(path, dtype="float32").generate([[1, 2, 3, 4, 5]] * 4, params, use_tqdm=False)


_generate_once()
