"""DeepInfer: a small, readable LLM inference engine.

The public names are imported lazily, so that tools which only read the
engine's source (the edition checker, the book's build) do not pay for
importing torch.
"""

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.core.llm_engine",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
}

if TYPE_CHECKING:
    from engine.core.llm_engine import LLMEngine
    from engine.llm import LLM
    from engine.outputs import RequestOutput
    from engine.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")


__all__ = [
    "LLM",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]
