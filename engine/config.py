"""Configuration: what the checkpoint says about the model, and how to serve it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Architectures the engine can run, by the name config.json gives them.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


@dataclass
class ModelConfig:
    """The parts of a Hugging Face config.json that the forward pass needs."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # biases on the q, k and v projections (Qwen2)
    qk_norm: bool  # RMSNorm on each head's q and k before RoPE (Qwen3)
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_pretrained(cls, path: Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        arch = (raw.get("architectures") or ["<none>"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in {path / 'config.json'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; supported: silu")
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        heads = raw["num_attention_heads"]
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(raw, rope_scaling),
            rope_scaling=_rope_scaling(rope_scaling, raw),
            max_position_embeddings=raw.get("max_position_embeddings", 4096),
            tie_word_embeddings=raw.get("tie_word_embeddings", False),
            attention_bias=raw.get("attention_bias", arch == "Qwen2ForCausalLM"),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=_eos_ids(path, raw),
        )


def _rope_theta(raw: dict, rope: dict | None) -> float:
    if "rope_theta" in raw:
        return float(raw["rope_theta"])
    return float((rope or {}).get("rope_theta", 10000.0))


def _rope_scaling(rope: dict | None, raw: dict) -> dict | None:
    """Keep only scaling that changes the frequencies; 'default' means none."""
    if not rope:
        return None
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind == "default":
        return None
    if kind not in ("llama3", "yarn"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: llama3, yarn")
    rope = dict(rope, rope_type=kind)
    if kind == "yarn":  # the defaults transformers fills in
        longest = raw.get("max_position_embeddings", 4096)
        rope.setdefault("original_max_position_embeddings", longest)
        if rope.get("factor") is None:
            rope["factor"] = longest / rope["original_max_position_embeddings"]
    return rope


def _eos_ids(path: Path, raw: dict) -> tuple[int, ...]:
    """generation_config.json wins over config.json, as in transformers."""
    eos = raw.get("eos_token_id")
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


@dataclass
class EngineConfig:
    """How the engine serves one model. LLM(...) builds this from its keywords."""

    model: str
    device: str | None = None  # None: cuda when available, else cpu
    dtype: torch.dtype | str | None = None  # None: float32 on cpu, bfloat16 on cuda
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_fraction
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the checkpoint's, capped by the cache
    enable_prefix_caching: bool = True
    attention_backend: str | None = None  # None: "triton" on cuda, else "torch"
    seed: int = 0
    # None: 0.9 of free GPU memory, or 0.2 of available RAM on CPU (see ModelRunner)
    kv_cache_memory_fraction: float | None = None
    enforce_eager: bool = False  # True: no CUDA graphs
    hf_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"model path {self.model!r} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {self.model!r} has no config.json")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.hf_config = ModelConfig.from_pretrained(path)
        self.device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.dtype is None:
            self.dtype = torch.float32 if self.device == "cpu" else torch.bfloat16
        elif isinstance(self.dtype, str):
            self.dtype = getattr(torch, self.dtype)
        if self.attention_backend is None:
            self.attention_backend = "triton" if self.device.startswith("cuda") else "torch"
        if self.attention_backend not in ("torch", "triton"):
            raise ValueError(
                f"attention_backend must be 'torch' or 'triton', got {self.attention_backend!r}"
            )
