"""A pytest plugin for `make mutate` only (pyproject's [tool.mutmut]): what every
mutant's test run would otherwise import or build again, done once.

mutmut forks one worker per mutant from a server that has collected the tests.
Collection does not reach the transformers model classes the checkpoint fixtures
import lazily, the C++ op the engine loads on first use, or Inductor's probe of
the CPU's vector ISA (the compiled decode asks it; it compiles test programs).
Together they cost a worker about ten seconds, more than most mutants' tests.
Done here, in the server, they are done for every fork.

Nothing here runs a tensor op or a grammar compile: either starts a thread pool
(OpenMP's, xgrammar's) that a fork inherits without its threads, and the worker
then waits forever at its first parallel region, which mutmut reports as a
timeout.
"""

from __future__ import annotations

import transformers.models.deepseek_v3.modeling_deepseek_v3  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401
from hypothesis import Phase, settings

import engine.csrc
from engine.runner.compiled_decode import vector_isa

engine.csrc.load()
vector_isa()

# A mutant that a property test catches fails at once: no shrinking to a smallest
# example (minutes, against the mutant's time limit), and no example database.
phases = (Phase.explicit, Phase.reuse, Phase.generate)
settings.register_profile("mutate", phases=phases, database=None)
settings.load_profile("mutate")
