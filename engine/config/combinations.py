"""What the engine cannot do yet with two settings together, refused in one
place, each with its reason. Each part of the config has already checked what
it can judge alone (parts.py); these run once the checkpoint, the device, the
dtype and the attention backend are known (EngineConfig.__post_init__)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.config.engine import EngineConfig


def refuse_combinations(c: EngineConfig) -> None:
    """ValueError, with its reason, for the first combination the engine cannot run."""
    for check in (
        check_async_scheduling,
        check_batch_invariant,
        check_kv_cache_dtype,
        check_kv_window,
        check_kv_store,
        check_deepseek_v4,
        check_quantization,
    ):
        check(c)


def check_async_scheduling(c: EngineConfig) -> None:
    """One-step-ahead scheduling against what must see each step's result first."""
    if not c.async_scheduling:
        return
    if c.parallel.places_experts:
        raise ValueError("expert parallelism and EPLB need async_scheduling=False")
    if c.speculative_config is not None:
        raise ValueError(
            "speculative_config needs async_scheduling=False: a step's drafts are "
            "proposed from the request's newest token, which one-step-ahead scheduling "
            "has not seen yet, and the step after a verify depends on how many "
            "drafts it accepted"
        )


def check_batch_invariant(c: EngineConfig) -> None:
    """What batch-invariant mode cannot run on yet."""
    if c.batch_invariant and c.attention_backend == "cpu":
        raise ValueError(
            "batch_invariant=True needs attention_backend 'torch' or 'triton': the 'cpu' "
            "backend attends prompt chunks in batch-dependent order"
        )
    if c.batch_invariant and c.hf_config.mla is not None and not c.device.startswith("cuda"):
        raise ValueError(
            "batch_invariant=True does not support MLA models (DeepSeek) on the CPU yet: "
            "the torch backend's split-KV path has no absorbed MLA decode"
        )


def check_kv_cache_dtype(c: EngineConfig) -> None:
    """What a quantized KV cache cannot run on yet."""
    if c.kv_cache_dtype == "auto":
        return
    if c.batch_invariant:
        raise ValueError(
            f"kv_cache_dtype={c.kv_cache_dtype!r} does not combine with "
            "batch_invariant=True yet: the split-KV attention path reads only an "
            "unquantized cache"
        )
    if c.hf_config.mla is not None and c.attention_backend == "triton":
        raise ValueError(
            f"kv_cache_dtype={c.kv_cache_dtype!r} on an MLA model (DeepSeek) needs "
            "attention_backend 'torch' or 'cpu': the Triton MLA decode kernel reads "
            "only an unquantized latent"
        )


def check_kv_window(c: EngineConfig) -> None:
    """A window and MTP drafts: the module reads the tables with holes in them."""
    spec = c.speculative_config
    if c.kv_window is not None and spec is not None and spec.method == "mtp":
        raise ValueError(
            "kv_window does not support speculative_config method 'mtp' yet: the MTP "
            "module reads the block tables with the window's holes in them "
            "(engine/spec_decode/mtp.py)"
        )


def check_kv_store(c: EngineConfig) -> None:
    """Nothing a store cannot hold: a window's holes, blocks spread over ranks."""
    if c.kv_store is None:
        return
    if c.kv_window is not None:
        raise ValueError(
            "kv_store does not combine with kv_window: a windowed request's blocks are "
            "freed as it runs, and those computed after are never published"
        )
    if c.expert_parallel_size > 1:
        raise ValueError("kv_store needs expert_parallel_size 1: one pool to copy blocks from")
    if c.async_scheduling:
        raise ValueError("kv_store needs async_scheduling=False: loads land between steps")
    if not c.enable_prefix_caching:
        raise ValueError("kv_store needs prefix caching: blocks are filed by its hash chains")


def check_deepseek_v4(c: EngineConfig) -> None:
    """What DeepSeek-V4 cannot run yet: it keeps a window of its own (set by
    EngineConfig), so a caller's kv_window, a store and a draft model are refused."""
    if c.hf_config.v4 is None:
        return
    for name, unsupported in (
        ("kv_window", c.kv_window is not None),
        ("kv_store", c.kv_store is not None),
    ):
        if unsupported:
            raise ValueError(
                f"{name} is not supported on DeepSeek-V4 yet: V4 keeps its own sliding "
                "window and compressor state in the paged cache, read by position"
            )
    spec = c.speculative_config
    if spec is not None and spec.method not in ("ngram", "mtp"):
        raise ValueError(
            f"speculative_config method {spec.method!r} is not supported on DeepSeek-V4 "
            "yet: its drafts come from another model, whose cache is not V4's "
            "(ngram and mtp are)"
        )


def check_quantization(c: EngineConfig) -> None:
    """Weight-only int8 and int4: on a CPU, of a checkpoint that is not already FP8."""
    if c.quantization is None:
        return
    if c.quantization not in ("int8", "int4"):
        raise ValueError(f"quantization must be 'int8' or 'int4', got {c.quantization!r}")
    refused = {
        "its checkpoint is already FP8": c.hf_config.fp8 is not None,
        "the device is not a CPU": c.device != "cpu",
        "expert_parallel_size > 1": c.expert_parallel_size > 1,
        "batch_invariant=True": c.batch_invariant,
    }
    for reason, applies in refused.items():
        if applies:
            raise ValueError(f"quantization={c.quantization!r} is refused: {reason}")
