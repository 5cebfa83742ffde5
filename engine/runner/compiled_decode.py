"""The decode step, compiled: torch.compile over the model's forward pass.

A decode step on the CPU runs a few hundred small torch operations per layer:
the norms, the rotary embedding, the residual adds, SiLU. Each is a dispatch
from Python and a pass over memory. torch.compile traces the forward pass once
into a graph, and Inductor fuses those elementwise runs into a few loops of
generated C++. The matmuls stay library calls, and attention stays the
backend's: under compilation each attention layer is one opaque operator,
``deepinfer::attention`` (engine/layers/attention.py), which writes the new
keys and values into the cache and attends over it (MLA's is
``deepinfer::mla_attention``). The cache never enters the graph, so the
compiler can neither copy it nor see the per-layer views it is read through.
A MoE layer's routed experts are one operator too, ``deepinfer::moe_experts``:
each expert's matmul is sized from the routing, on the host; the router and
the shared experts around it are compiled (engine/layers/opaque.py).

Only steps in which every sequence decodes run compiled: their shapes differ
only in the batch size, which is marked unbacked (any size, 1 included), so one
graph serves every batch. Compiling takes seconds; Inductor caches what it
built on disk (TORCHINDUCTOR_CACHE_DIR), so a later process compiles faster.

compile_mode="max-autotune" goes further with the matmuls. A oneDNN call costs
about 17 us however small its weight, and a decode step of a small model makes
a few dozen. Under this mode the weights are constants of the graph (Inductor's
freezing), and Inductor times its own C++ GEMM kernels, written for this CPU's
vector units, against oneDNN for each matmul and keeps the faster. The price:
the graph holds its own packed copy of the weights, beside the model's row-major
ones that prefill steps still read (so the model's are not packed), and compiling
takes several times longer. Those kernels pick their tiling from a size hint,
which an unbacked size lacks, so a batch of one gets a graph of its own and every
larger batch shares another.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.layers import opaque
from engine.models.base import CausalLM

logger = logging.getLogger(__name__)

# Inductor's settings while a "max-autotune" step compiles: the weights as constants,
# and Inductor's C++ GEMMs timed against oneDNN's (ATen's) for each matmul.
AUTOTUNE = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}


def can_compile(model: nn.Module, device: torch.device) -> str | None:
    """Why the decode step of this model on this device cannot be compiled, or None."""
    if device.type != "cpu":
        return "it is for the CPU; on CUDA the decode step replays CUDA graphs"
    if not getattr(model, "supports_compile", False):  # any nn.Module may be passed
        return f"{type(model).__name__} does not support it (Llama, Qwen and DeepSeek-V3 models do)"
    if not vector_isa():
        return (
            "torch's compiler finds no C++ compiler, or no vector ISA on this CPU (or"
            " ATEN_CPU_CAPABILITY=default), and the scalar C++ it then writes does not build"
        )
    return None


def vector_isa() -> bool:
    """Can Inductor's CPU code generator build vector code (AVX2, AVX-512, NEON...) here?
    Finding out compiles a probe, so a missing C++ compiler answers no as well."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    try:
        return bool(pick_vec_isa())
    except Exception:  # InvalidCxxCompiler, a failed probe build: nothing to compile with
        return False


class CompiledDecode:
    """The model's forward pass for decode-only steps, through torch.compile."""

    builds_own_metadata = False  # a DecodeFastPath (fast_path.py) that runs the backend's

    def __init__(
        self, model: nn.Module, backend: AttentionBackend[Any], mode: str = "default"
    ) -> None:
        self.backend = backend
        self.autotune = mode == "max-autotune"
        self.freezes_weights = self.autotune  # its graph copies them: leave the model's be
        dynamic = None if self.autotune else True  # None: the sizes marked below
        tag_caches_with_isa()  # before anything compiles: see isa_cache_tag
        self.fn: Callable[..., torch.Tensor] = torch.compile(model.forward, dynamic=dynamic)
        self.warm_batches = (2, 1) if self.autotune else (2,)  # a graph for each
        self.layers = model.opaque_layers()
        for i, layer in enumerate(self.layers):  # what the graph names each layer by
            layer.index = i
        self.compile_seconds = 0.0  # the calls that compiled, summed
        self.compiles = 0
        self.steps = 0  # steps run through the compiled graph

    @staticmethod
    def can_run(meta: AttentionMetadata) -> bool:
        return meta.decodes_only()

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        attn_metadata: Any,
    ) -> torch.Tensor:
        with forward_context(meta, attn_metadata, self.backend):
            return self(input_ids, positions)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        graphs = _graphs_compiled()
        start = time.perf_counter()
        if not self.autotune:  # "any size", so that a batch of one needs no graph of its own
            torch._dynamo.decorators.mark_unbacked(input_ids, 0)
            torch._dynamo.decorators.mark_unbacked(positions, 0)
        elif input_ids.shape[0] > 1:  # any size from 2, with a hint; 1 is its own
            torch._dynamo.mark_dynamic(input_ids, 0)
            torch._dynamo.mark_dynamic(positions, 0)
        with opaque.running(self.layers), self._settings():
            hidden = self.fn(input_ids, positions)
        self.steps += 1
        if _graphs_compiled() > graphs:  # this call traced and compiled a graph
            seconds = time.perf_counter() - start
            self.compile_seconds += seconds
            self.compiles += 1
            hits = torch._dynamo.utils.counters["inductor"]["fxgraph_cache_hit"]
            logger.info(
                "DeepInfer: compiled the decode step (batch %d) in %.1f s; "
                "Inductor cache hits so far: %d",
                input_ids.shape[0],
                seconds,
                hits,
            )
        return hidden

    def _settings(self) -> contextlib.AbstractContextManager:
        """Inductor's settings for this mode, for a call that may compile."""
        if not self.autotune:
            return contextlib.nullcontext()
        return torch._inductor.config.patch(AUTOTUNE)


def tag_caches_with_isa() -> None:
    """Name the vector ISA in every compile cache key of this process (once; the ISA
    cannot change within a process, and a key that says more misleads no one)."""
    tag = torch.compiler.config.cache_key_tag
    if "cpu-vec-isa=" not in tag:
        torch.compiler.config.cache_key_tag = isa_cache_tag()


def isa_cache_tag() -> str:
    """The compile caches' key tag, with the vector ISA Inductor writes code for.

    Inductor's on-disk caches key a compiled graph by the graph, torch's version,
    its settings and the thread count, but not by the vector ISA it chose
    (AVX-512, AVX2, ... : ATEN_CPU_CAPABILITY caps it). The graph it caches holds
    its C++ kernels' source, written for that ISA's vector width, and a process
    that finds it builds that source for its own ISA. Loops written to step 8
    floats then store 16 on AVX-512, past the end of each buffer (glibc aborts:
    "corrupted size vs. prev_size"), and loops written to step 16 store 8 on
    AVX2, leaving half of each output unwritten (wrong tokens). A process capped
    at AVX2 and one at AVX-512 sharing one cache met exactly that. So the tag,
    which every cache key includes, carries the ISA too."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    isa = str(pick_vec_isa()).replace(" ", "+") or "scalar"
    user = torch.compiler.config.cache_key_tag
    return f"{user}|cpu-vec-isa={isa}" if user else f"cpu-vec-isa={isa}"


def _graphs_compiled() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def compiled_decode_for(
    config: EngineConfig, model: CausalLM, backend: AttentionBackend, device: torch.device
) -> CompiledDecode | None:
    """The compiled decode step the config asks for, where the model and device
    allow it; None when off. compile_decode=True that cannot be honoured is a
    ValueError that says why."""
    want = config.compile_decode
    if config.enforce_eager:
        why_not = "enforce_eager=True asks for no compilation"
    elif want is False:  # off (the default): skip the probe, seconds of compiler runs
        return None
    elif config.expert_parallel_size > 1:
        why_not = "under expert parallelism each MoE layer exchanges tokens between ranks"
    else:
        why_not = can_compile(model, device)
    if want and why_not:
        raise ValueError(f"compile_decode=True cannot be honoured: {why_not}")
    if want is False or why_not:  # None: wherever it can run
        return None
    return CompiledDecode(model, backend, config.compile_mode)
