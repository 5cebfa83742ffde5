"""Configuration: how the engine serves one model. What the checkpoint says about
the model is in config/model.py."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config.cache_groups import KVCacheGroups, SpanGroup
from engine.config.combinations import refuse_combinations
from engine.config.model import ModelConfig
from engine.config.parts import (
    COMPILE_MODES,
    CacheConfig,
    CompileConfig,
    KVTransferConfig,
    ParallelConfig,
    SchedulerConfig,
)
from engine.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

__all__ = ["COMPILE_MODES", "EngineConfig", "cpu_has_fast_bf16", "default_cpu_dtype"]


@dataclass
class EngineConfig:
    """How the engine serves one model. LLM(...) builds this from its keywords,
    flat as vLLM's engine arguments are; its parts (cache, scheduler, compile,
    parallel, kv_transfer: parts.py) each check themselves, and what they cannot
    do together is refused in one place (combinations.py)."""

    model: str
    device: str | None = None  # None: cuda when available, else cpu
    dtype: torch.dtype | str | None = None  # None: bfloat16, or float32 on a CPU without
    # fast bf16 matmul (see default_cpu_dtype)
    block_size: int = 16
    # The KV cache's element format: "auto", the model's dtype; "fp8_e4m3" or "int8",
    # one byte a number with float32 scales beside them (engine/kv/quant.py).
    kv_cache_dtype: str = "auto"
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_fraction
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the checkpoint's, capped by the cache
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: see _default_backend
    seed: int = 0
    # None: 0.9 of free GPU memory, or 0.2 of available RAM on CPU (see ModelRunner)
    kv_cache_memory_fraction: float | None = None
    enforce_eager: bool = False  # True: no CUDA graphs, and no compiled decode step
    # Run decode-only steps through torch.compile (compiled_decode.py), on the CPU:
    # faster steps for seconds of compiling at start-up. None: wherever the model and
    # device allow it, as `deepinfer serve` does.
    compile_decode: bool | None = False
    # How it compiles (COMPILE_MODES): "max-autotune" also has Inductor write the
    # step's matmuls as C++ for this CPU, from a second copy of the weights.
    compile_mode: str = "default"
    # True: a request's logits are bitwise the same whatever else is in the batch,
    # at some cost in speed (engine/layers/batch_invariant.py).
    batch_invariant: bool = False
    # Schedule step N+1 while step N's forward pass runs (async_loop.py); vLLM's name.
    async_scheduling: bool = False
    # JSON grammars (a json schema, json_object) compile without free whitespace
    # outside strings, for every request, as vLLM's option of that name: a small
    # model can otherwise fill max_tokens with newlines. False: each request's own
    # StructuredOutputsParams.disable_any_whitespace decides.
    disable_any_whitespace: bool = False
    # Record when each stage of each step ran (trace.py): True keeps it in memory,
    # a path also writes it there as a Chrome trace when generate returns.
    trace: bool | str = False
    # Expert parallelism (engine/distributed/): the routed experts spread over this
    # many processes (ranks) in one torch.distributed group; 1 keeps them all here.
    expert_parallel_size: int = 1
    # EPLB: every eplb_interval steps, place the experts anew from the load recorded
    # so far, with num_redundant_experts slots per layer beyond one per expert.
    enable_eplb: bool = False
    eplb_interval: int = 32
    num_redundant_experts: int = 0
    # How long a collective may wait for a rank before the engine gives up on it.
    distributed_timeout_s: float = 60.0
    # Speculative decoding (engine/spec_decode/): a SpeculativeConfig, or its
    # vLLM-shaped dict or JSON text; None: none.
    speculative_config: SpeculativeConfig | dict | str | None = None
    # A sliding window with attention sinks, (sinks, window): a request keeps the
    # blocks that hold its first `sinks` tokens and its last `window` computed ones,
    # and gives back those between while it runs (Scheduler._slide). None: all.
    kv_window: tuple[int, int] | None = None
    # A KV cache store shared by workers (engine/kv/store/, Chapter 8): a directory,
    # or a redis:// URL. Full prompt blocks are saved there and loaded instead of
    # recomputed, by this engine or another. None: no store.
    kv_store: str | None = None
    kv_store_max_bytes: int = 1 << 30  # a directory store's size bound (LRU beyond it)
    # When a stored prefix is loaded rather than recomputed: "measured", when this
    # engine's own timings say loading is cheaper; "always". A handed-on request
    # always loads.
    kv_store_load: str = "measured"
    # A server's part in prefill/decode disaggregation: "prefill" runs prompts and
    # hands them on through the store, "decode" continues them, "both" does all.
    role: str = "both"
    # Weight-only quantization at load, vLLM's names: "int8" (a scale per output
    # row) or "int4" (a scale per 128 inputs), engine/layers/quantization/. None:
    # the checkpoint's own format (DeepSeek's FP8 is read as it is stored).
    quantization: str | None = None
    hf_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"model path {self.model!r} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {self.model!r} has no config.json")
        self.kv_window = self.cache.check()
        self.scheduler.check()
        self.compile.check()
        self.kv_transfer.check()
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}"
            )
        self.hf_config = ModelConfig.from_pretrained(path)
        self.parallel.check(self.hf_config.routed_experts())
        if self.speculative_config is not None:  # parsed (ValueError if bad); MTP needs weights
            self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
            self.speculative_config.check_target(self.hf_config)
        self._resolve_device()
        refuse_combinations(self)
        if self.hf_config.v4 is not None:  # V4 keeps its own window (compressed_cache.py)
            self.kv_window = (0, self.hf_config.v4.window_tokens())

    def _resolve_device(self) -> None:
        """The device, dtype and attention backend, where left to the engine."""
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.dtype is None:
            self.dtype = default_cpu_dtype() if self.device == "cpu" else torch.bfloat16
        elif isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype)
        if self.attention_backend is None:
            self.attention_backend = self._default_backend()
        if self.attention_backend not in ("torch", "cpu", "triton"):
            raise ValueError(
                "attention_backend must be 'torch', 'cpu' or 'triton', "
                f"got {self.attention_backend!r}"
            )

    @property
    def cache(self) -> CacheConfig:
        return CacheConfig(
            self.block_size,
            self.kv_cache_dtype,
            self.num_kv_blocks,
            self.kv_cache_memory_fraction,
            self.enable_prefix_caching,
            self.kv_window,
        )

    @property
    def scheduler(self) -> SchedulerConfig:
        args = self.max_num_seqs, self.max_num_batched_tokens, self.max_model_len
        return SchedulerConfig(*args, self.async_scheduling)

    @property
    def compile(self) -> CompileConfig:
        return CompileConfig(self.enforce_eager, self.compile_decode, self.compile_mode)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(
            self.expert_parallel_size,
            self.enable_eplb,
            self.eplb_interval,
            self.num_redundant_experts,
            self.distributed_timeout_s,
        )

    @property
    def kv_transfer(self) -> KVTransferConfig:
        args = self.kv_store, self.kv_store_max_bytes, self.kv_store_load, self.role
        return KVTransferConfig(*args)

    @property
    def kv_format(self) -> str:
        """What one cached element is: with "auto", the model's dtype."""
        if self.kv_cache_dtype != "auto":
            return f"{self.kv_cache_dtype}+{str(self.dtype).removeprefix('torch.')}"
        return str(self.dtype).removeprefix("torch.")

    @property
    def model_identity(self) -> str:
        """The model, as the prefix cache's hash chains name it, with its cache's
        span groups: DeepSeek-V4's hits are of whole row spans only."""
        name = f"{self.hf_config.architecture}:{Path(self.model).resolve().name}"
        return name + self.kv_cache_groups.describe()

    @property
    def kv_cache_groups(self) -> KVCacheGroups:
        """The cache's groups (config/cache_groups.py): the token group, read raw
        over kv_window's window (0: every token), and DeepSeek-V4's row blocks, a
        span group of V4Config.row_span tokens; no span group for any other model."""
        window = self.kv_window[1] if self.kv_window else 0
        v4 = self.hf_config.v4
        span = 0 if v4 is None else v4.row_span(self.block_size)
        spans = (SpanGroup(span),) if span else ()
        return KVCacheGroups(self.block_size, window, spans)

    def _default_backend(self) -> str:
        """Triton's kernels on a GPU. On the CPU, the C++ decode operator when it
        builds here and supports the dtype, else the plain torch reference; in
        batch-invariant mode, always torch, whose split-KV path the mode needs."""
        if self.device.startswith("cuda"):
            return "triton"
        if self.batch_invariant:
            return "torch"  # its split-KV path (engine/attention/torch_split_kv.py)
        from engine import csrc

        if self.dtype in (torch.float32, torch.bfloat16) and csrc.load():
            return "cpu"
        return "torch"


def cpu_has_fast_bf16() -> bool:
    """Does this CPU multiply bf16 matrices in hardware (AVX512-BF16 or AMX)?
    Without either, oneDNN widens bf16 to fp32 and a bf16 matmul is no faster."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(cpu, name, lambda: False)() for name in checks)


@functools.cache
def default_cpu_dtype() -> torch.dtype:
    """bf16 where the CPU does bf16 matmul well, else fp32; said once, at the first engine."""
    fast = cpu_has_fast_bf16()
    dtype = torch.bfloat16 if fast else torch.float32
    why = "has AVX512-BF16 or AMX" if fast else "has neither AVX512-BF16 nor AMX"
    logger.info("DeepInfer: CPU dtype %s (this CPU %s); pass dtype= to choose", dtype, why)
    return dtype
