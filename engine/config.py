"""Configuration: what the checkpoint says about the model, and how to serve it."""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# Architectures the engine can run, by the name config.json gives them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM",
)


@dataclass
class MLAConfig:
    """Multi-head latent attention's shapes (DeepSeek-V3)."""

    q_lora_rank: int | None  # None: queries come straight from the hidden state
    kv_lora_rank: int  # the latent each token caches, shared by every head
    qk_nope_head_dim: int  # per head: the part of q.k without position
    qk_rope_head_dim: int  # the rotary part; its key is shared by every head and cached
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3), ... in the checkpoint


@dataclass
class MoEConfig:
    """DeepSeek-V3's mixture of experts, in the layers after the first dense ones."""

    num_experts: int  # routed experts
    num_shared_experts: int
    intermediate_size: int  # of one expert
    top_k: int
    num_groups: int
    topk_groups: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    first_k_dense_replace: int  # layers before this index are dense


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
    mla: MLAConfig | None = None  # DeepSeek-V3 only, as are the two below
    moe: MoEConfig | None = None
    num_mtp_layers: int = 0  # multi-token prediction modules stored after the layers

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
        deepseek = arch == "DeepseekV3ForCausalLM"
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
            mla=_mla(raw) if deepseek else None,
            moe=_moe(raw) if deepseek else None,
            num_mtp_layers=raw.get("num_nextn_predict_layers", 0) if deepseek else 0,
        )


# What transformers' DeepseekV3Config reads for a field config.json leaves out:
# DeepSeek-V3's own values. A checkpoint that omits one means this, so the engine
# reads it too. An explicit null still means none (q_lora_rank) or one group.
DEEPSEEK_DEFAULTS = {
    "q_lora_rank": 1536,
    "rope_interleave": True,
    "n_shared_experts": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 3,
}


def _deepseek(raw: dict, name: str):
    return raw.get(name, DEEPSEEK_DEFAULTS[name])


def _mla(raw: dict) -> MLAConfig:
    return MLAConfig(
        q_lora_rank=_deepseek(raw, "q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        rope_interleave=_deepseek(raw, "rope_interleave"),
    )


# DeepSeek config fields the engine implements one value of: a checkpoint that
# names another value would run, wrongly, if we did not stop it here.
DEEPSEEK_VARIANTS = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}


def _moe(raw: dict) -> MoEConfig:
    for name, supported in DEEPSEEK_VARIANTS.items():
        if raw.get(name, supported) != supported:
            raise ValueError(
                f"unsupported {name} {raw[name]!r} in config.json; supported: {supported!r}"
            )
    experts, groups = raw["n_routed_experts"], _deepseek(raw, "n_group") or 1
    if experts % groups:
        raise ValueError(f"n_routed_experts {experts} is not divisible by n_group {groups}")
    return MoEConfig(
        num_experts=experts,
        num_shared_experts=_deepseek(raw, "n_shared_experts") or 0,
        intermediate_size=raw["moe_intermediate_size"],
        top_k=raw["num_experts_per_tok"],
        num_groups=groups,
        topk_groups=_deepseek(raw, "topk_group") or 1,
        norm_topk_prob=_deepseek(raw, "norm_topk_prob"),
        routed_scaling_factor=_deepseek(raw, "routed_scaling_factor"),
        first_k_dense_replace=_deepseek(raw, "first_k_dense_replace"),
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
    dtype: torch.dtype | str | None = None  # None: bfloat16, or float32 on a CPU without
    # fast bf16 matmul (see default_cpu_dtype)
    block_size: int = 16
    # The KV cache's element format. "auto": the model's dtype, the only one so far.
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
    # True: a request's logits are bitwise the same whatever else is in the batch,
    # at some cost in speed (engine/layers/batch_invariant.py).
    batch_invariant: bool = False
    # Schedule step N+1 while step N's forward pass runs (async_loop.py); vLLM's name.
    async_scheduling: bool = False
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
    hf_config: ModelConfig = field(init=False)

    def __post_init__(self) -> None:
        path = Path(self.model)
        if not path.is_dir():
            raise ValueError(f"model path {self.model!r} is not a directory")
        if not (path / "config.json").is_file():
            raise ValueError(f"model path {self.model!r} has no config.json")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
        if self.kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype must be 'auto', got {self.kv_cache_dtype!r}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
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
        if self.batch_invariant and self.attention_backend == "cpu":
            raise ValueError(
                "batch_invariant=True needs attention_backend 'torch' or 'triton': the 'cpu' "
                "backend attends prompt chunks in batch-dependent order"
            )

    @property
    def kv_format(self) -> str:
        """What one cached element is: with "auto", the model's dtype."""
        return str(self.dtype).removeprefix("torch.")

    @property
    def model_identity(self) -> str:
        """The model, as the prefix cache's hash chains name it."""
        return f"{self.hf_config.architecture}:{Path(self.model).resolve().name}"

    def _check_expert_parallel(self) -> None:
        ep, moe = self.expert_parallel_size, self.hf_config.moe
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
