"""A pytest plugin for `make mutate` only (pyproject's [tool.mutmut]): what every
mutant's test run would otherwise import or build again, done once.

mutmut forks one worker per mutant from a server that has collected the tests.
Collection does not reach the transformers model classes the checkpoint fixtures
import lazily, the C++ op the engine loads on first use, or Inductor's probe of
the CPU's vector ISA (the compiled decode asks it; it compiles test programs).
Nor does it warm what a first generate pays for once: oneDNN's kernels for the
test model's shapes. Together these cost a worker some twenty seconds, more than
most mutants' tests. Done here, in the server, they are done for every fork.
`make mutate` runs with OMP_NUM_THREADS=1 and TOKENIZERS_PARALLELISM=false, so the
server starts no thread pool that a fork could inherit half-held.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401
from hypothesis import Phase, settings

import engine.csrc
from engine import LLM, SamplingParams
from engine.compiled_decode import vector_isa
from tests.engine.conftest import build_checkpoint


def generate_once() -> None:
    """One short generate on the suite's tiny Qwen3 (its fixture's weights and
    shapes): greedy, seeded with every filter and logprobs, and a stop string.
    No grammar: xgrammar compiles on a thread pool, which a fork would inherit
    without its threads, and the worker's first grammar would wait forever."""
    path = Path(tempfile.mkdtemp()) / "qwen3"
    build_checkpoint("qwen3", path)
    hot = {"temperature": 1.0, "seed": 1, "top_k": 5, "top_p": 0.9, "min_p": 0.01}
    params = [
        SamplingParams(max_tokens=4),
        SamplingParams(max_tokens=4, logprobs=2, **hot),
        SamplingParams(max_tokens=4, stop=["x"]),
    ]
    LLM(path, dtype="float32").generate([[1, 2, 3, 4, 5]] * 3, params, use_tqdm=False)


engine.csrc.load()
vector_isa()
generate_once()

# A mutant that a property test catches fails at once: no shrinking to a smallest
# example (minutes, against the mutant's time limit), and no example database.
phases = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile("mutate", phases=phases, database=None)
settings.load_profile("mutate")
