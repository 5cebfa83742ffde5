"""Configuration: how the engine serves one model. What the checkpoint says about
the model is in config/model.py."""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config.kv_format import quant_format
from engine.config.model import ModelConfig
from engine.config.speculative import SpeculativeConfig

logger = logging.getLogger(__name__)

# torch.compile's names: "default" leaves the matmuls to oneDNN; "max-autotune" has
# Inductor try its own C++ GEMMs for them (engine/runner/compiled_decode.py).
COMPILE_MODES = ("default", "max-autotune")


@dataclass
class EngineConfig:
    """How the engine serves one model. LLM(...) builds this from its keywords."""

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
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        quant_format(self.kv_cache_dtype)  # ValueError unless a known format
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}"
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise ValueError(
                f"disable_any_whitespace must be True or False, got {self.disable_any_whitespace!r}"
            )
        self.hf_config = ModelConfig.from_pretrained(path)
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
        self._check_expert_parallel()
        self._check_speculative()
        self._check_batch_invariant()
        self._check_kv_cache_dtype()
        self._check_kv_window()
        self._check_kv_store()
        self._check_deepseek_v4()
        self._check_quantization()

    def _check_kv_cache_dtype(self) -> None:
        """What a quantized KV cache cannot run on yet."""
        if self.kv_cache_dtype == "auto":
            return
        if self.batch_invariant:
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} does not combine with "
                "batch_invariant=True yet: the split-KV attention path reads only an "
                "unquantized cache"
            )
        if self.hf_config.mla is not None and self.attention_backend == "triton":
            raise ValueError(
                f"kv_cache_dtype={self.kv_cache_dtype!r} on an MLA model (DeepSeek) needs "
                "attention_backend 'torch' or 'cpu': the Triton MLA decode kernel reads "
                "only an unquantized latent"
            )

    def _check_quantization(self) -> None:
        if self.quantization is None:
            return
        if self.quantization not in ("int8", "int4"):
            raise ValueError(f"quantization must be 'int8' or 'int4', got {self.quantization!r}")
        refused = {
            "its checkpoint is already FP8": self.hf_config.fp8 is not None,
            "the device is not a CPU": self.device != "cpu",
            "expert_parallel_size > 1": self.expert_parallel_size > 1,
            "batch_invariant=True": self.batch_invariant,
        }
        for reason, applies in refused.items():
            if applies:
                raise ValueError(f"quantization={self.quantization!r} is refused: {reason}")

    def _check_batch_invariant(self) -> None:
        """What batch-invariant mode cannot run on yet."""
        if self.batch_invariant and self.attention_backend == "cpu":
            raise ValueError(
                "batch_invariant=True needs attention_backend 'torch' or 'triton': the 'cpu' "
                "backend attends prompt chunks in batch-dependent order"
            )
        if (
            self.batch_invariant
            and self.hf_config.mla is not None
            and not self.device.startswith("cuda")
        ):
            raise ValueError(
                "batch_invariant=True does not support MLA models (DeepSeek) on the CPU yet: "
                "the torch backend's split-KV path has no absorbed MLA decode"
            )

    @property
    def kv_format(self) -> str:
        """What one cached element is: with "auto", the model's dtype."""
        if self.kv_cache_dtype != "auto":
            return f"{self.kv_cache_dtype}+{str(self.dtype).removeprefix('torch.')}"
        return str(self.dtype).removeprefix("torch.")

    @property
    def model_identity(self) -> str:
        """The model, as the prefix cache's hash chains name it: for DeepSeek-V4 with
        its cache layout, hits of whole row spans of kv_row_span tokens only."""
        name = f"{self.hf_config.architecture}:{Path(self.model).resolve().name}"
        return f"{name}:row-spans-of-{self.kv_row_span}" if self.kv_row_span else name

    def _check_expert_parallel(self) -> None:
        ep, moe = self.expert_parallel_size, self.hf_config.routed_experts()
        if ep < 1 or self.num_redundant_experts < 0 or self.eplb_interval < 1:
            raise ValueError(
                "expert_parallel_size and eplb_interval must be at least 1, "
                "num_redundant_experts at least 0"
            )
        if moe is None and (ep > 1 or self.enable_eplb or self.num_redundant_experts):
            raise ValueError("expert parallelism and EPLB need a mixture-of-experts model")
        if moe is not None and (moe.num_experts + self.num_redundant_experts) % ep:
            raise ValueError(
                f"{moe.num_experts} experts + {self.num_redundant_experts} redundant slots "
                f"do not divide among expert_parallel_size {ep} ranks"
            )
        if (ep > 1 or self.enable_eplb) and self.async_scheduling:
            raise ValueError("expert parallelism and EPLB need async_scheduling=False")

    def _check_speculative(self) -> None:
        """Parse speculative_config (ValueError if bad), and refuse what it cannot do."""
        if self.speculative_config is None:
            return
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.speculative_config.check_target(self.hf_config)  # MTP needs MTP weights
        if self.async_scheduling:
            raise ValueError(
                "speculative_config needs async_scheduling=False: a step's drafts are "
                "proposed from the request's newest token, which one-step-ahead scheduling "
                "has not seen yet, and the step after a verify depends on how many "
                "drafts it accepted"
            )

    def _check_kv_store(self) -> None:
        """A known role; a store for a prefill or decode role; nothing a store cannot
        hold (a window's holes, blocks spread over ranks)."""
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be 'prefill', 'decode' or 'both', got {self.role!r}")
        if self.kv_store_load not in ("measured", "always"):
            raise ValueError(
                f"kv_store_load must be 'measured' or 'always', got {self.kv_store_load!r}"
            )
        if self.kv_store is None:
            if self.role != "both":
                raise ValueError(f"role {self.role!r} needs kv_store: the blocks go through it")
            return
        if self.kv_window is not None:
            raise ValueError(
                "kv_store does not combine with kv_window: a windowed request's blocks are "
                "freed as it runs, and those computed after are never published"
            )
        if self.expert_parallel_size > 1:
            raise ValueError("kv_store needs expert_parallel_size 1: one pool to copy blocks from")
        if self.async_scheduling:
            raise ValueError("kv_store needs async_scheduling=False: loads land between steps")
        if not self.enable_prefix_caching:
            raise ValueError("kv_store needs prefix caching: blocks are filed by its hash chains")

    def _check_deepseek_v4(self) -> None:
        """DeepSeek-V4 runs under a window of its own: a request keeps the token
        blocks of its last V4Config.window_tokens() tokens and gives back the rest,
        while its row blocks stay (engine/kv/compressed_cache.py). What it cannot
        run yet."""
        v4 = self.hf_config.v4
        if v4 is None:
            return
        for name, unsupported in (
            ("kv_window", self.kv_window is not None),
            ("kv_store", self.kv_store is not None),
        ):
            if unsupported:
                raise ValueError(
                    f"{name} is not supported on DeepSeek-V4 yet: V4 keeps its own sliding "
                    "window and compressor state in the paged cache, read by position"
                )
        spec = self.speculative_config
        if spec is not None and spec.method not in ("ngram", "mtp"):
            raise ValueError(
                f"speculative_config method {spec.method!r} is not supported on DeepSeek-V4 "
                "yet: its drafts come from another model, whose cache is not V4's "
                "(ngram and mtp are)"
            )
        self.kv_window = (0, v4.window_tokens())

    @property
    def kv_row_span(self) -> int:
        """Tokens per row block, where DeepSeek-V4 keeps compressed rows
        (V4Config.row_span); 0 for every other model."""
        v4 = self.hf_config.v4
        return 0 if v4 is None else v4.row_span(self.block_size)

    def _check_kv_window(self) -> None:
        """A window of at least one block, sinks of none or more, and no MTP drafts."""
        if self.kv_window is None:
            return
        pair = tuple(self.kv_window)
        if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
            raise ValueError(f"kv_window must be a pair of integers (sinks, window), got {pair!r}")
        sinks, window = self.kv_window = pair
        if sinks < 0 or window < self.block_size:
            raise ValueError(
                f"kv_window (sinks={sinks}, window={window}) needs sinks >= 0 and a window of "
                f"at least one block (block_size {self.block_size})"
            )
        spec = self.speculative_config
        if spec is not None and spec.method == "mtp":
            raise ValueError(
                "kv_window does not support speculative_config method 'mtp' yet: the MTP "
                "module reads the block tables with the window's holes in them "
                "(engine/spec_decode/mtp.py)"
            )

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
