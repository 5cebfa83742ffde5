"""EngineConfig's settings in parts, as vLLM groups them: the cache, the
scheduler, compilation, expert parallelism and the KV store. Each part checks
what it can judge alone; what two parts cannot do together is refused in one
place, combinations.py. EngineConfig (engine.py) keeps the flat keywords that
LLM(...) and the command line take, and hands out these parts."""

from __future__ import annotations

from dataclasses import dataclass

from engine.config.kv_format import quant_format
from engine.config.model import RoutedExperts

# torch.compile's names: "default" leaves the matmuls to oneDNN; "max-autotune" has
# Inductor try its own C++ GEMMs for them (engine/runner/compiled_decode.py).
COMPILE_MODES = ("default", "max-autotune")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_dtype: str
    num_kv_blocks: int | None
    kv_cache_memory_fraction: float | None
    enable_prefix_caching: bool
    kv_window: tuple[int, int] | list[int] | None

    def check(self) -> tuple[int, int] | None:
        """ValueError unless every setting is valid; the window as a pair."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        quant_format(self.kv_cache_dtype)  # ValueError unless a known format
        return self._window()

    def _window(self) -> tuple[int, int] | None:
        """A window of at least one block, and sinks of none or more."""
        if self.kv_window is None:
            return None
        pair = tuple(self.kv_window)
        if len(pair) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) for n in pair):
            raise ValueError(f"kv_window must be a pair of integers (sinks, window), got {pair!r}")
        sinks, window = pair
        if sinks < 0 or window < self.block_size:
            raise ValueError(
                f"kv_window (sinks={sinks}, window={window}) needs sinks >= 0 and a window of "
                f"at least one block (block_size {self.block_size})"
            )
        return sinks, window


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int | None
    async_scheduling: bool

    def check(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


@dataclass(frozen=True)
class CompileConfig:
    enforce_eager: bool
    compile_decode: bool | None
    compile_mode: str

    def check(self) -> None:
        if self.compile_mode not in COMPILE_MODES:
            raise ValueError(
                f"compile_mode must be one of {', '.join(COMPILE_MODES)}, got {self.compile_mode!r}"
            )


@dataclass(frozen=True)
class ParallelConfig:
    expert_parallel_size: int
    enable_eplb: bool
    eplb_interval: int
    num_redundant_experts: int
    distributed_timeout_s: float

    def check(self, moe: RoutedExperts | None) -> None:
        """Valid counts, for a model with experts (``moe``) that divide among the ranks."""
        ep, extra = self.expert_parallel_size, self.num_redundant_experts
        if ep < 1 or extra < 0 or self.eplb_interval < 1:
            raise ValueError(
                "expert_parallel_size and eplb_interval must be at least 1, "
                "num_redundant_experts at least 0"
            )
        if moe is None and (ep > 1 or self.enable_eplb or extra):
            raise ValueError("expert parallelism and EPLB need a mixture-of-experts model")
        if moe is not None and (moe.num_experts + extra) % ep:
            raise ValueError(
                f"{moe.num_experts} experts + {extra} redundant slots "
                f"do not divide among expert_parallel_size {ep} ranks"
            )

    @property
    def places_experts(self) -> bool:
        """Are the experts placed by rank or by EPLB, rather than all here as loaded?"""
        return self.expert_parallel_size > 1 or self.enable_eplb


@dataclass(frozen=True)
class KVTransferConfig:
    kv_store: str | None
    kv_store_max_bytes: int
    kv_store_load: str
    role: str

    def check(self) -> None:
        """A known role and load rule, and a store for a prefill or decode role."""
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be 'prefill', 'decode' or 'both', got {self.role!r}")
        if self.kv_store_load not in ("measured", "always"):
            raise ValueError(
                f"kv_store_load must be 'measured' or 'always', got {self.kv_store_load!r}"
            )
        if self.kv_store is None and self.role != "both":
            raise ValueError(f"role {self.role!r} needs kv_store: the blocks go through it")
