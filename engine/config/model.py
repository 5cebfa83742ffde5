"""What a checkpoint's config.json says about the model: the shapes and options
the forward pass needs, read as transformers reads them."""

from __future__ import annotations

import json
import logging
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.config.deepseek_v4 import HASH_MOE, V4_ARCHITECTURE, V4Config, parse_v4
from engine.config.fp8_format import Fp8Format, fp8_format

logger = logging.getLogger(__name__)

# Architectures the engine can run, by the name config.json gives them.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "DeepseekV3ForCausalLM",
    "DeepseekV32ForCausalLM",
    V4_ARCHITECTURE,
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


@dataclass(frozen=True)
class RoutedExperts:
    """What expert parallelism and EPLB need to know of a model's routed experts."""

    num_layers: int  # MoE layers, the MTP modules' included, in the model's order
    num_experts: int  # routed experts per layer
    num_groups: int  # EPLB's expert groups (DeepSeek-V3's n_group)
    # Layers whose routing is a fixed table of token ids (DeepSeek-V4's hash layers):
    # placed like the others, but EPLB never moves them (ExpertBalancer.rebalance).
    fixed_layers: tuple[int, ...] = ()


@dataclass
class DSAConfig:
    """DeepSeek-V3.2's sparse attention (DSA): a lightning indexer scores every cached
    token for each query, and MLA attends only to the index_topk best."""

    index_topk: int  # tokens each query keeps
    index_n_heads: int  # the indexer's query heads; its key is one head, cached
    index_head_dim: int  # its first qk_rope_head_dim numbers carry the (neox-style) RoPE


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
    dsa: DSAConfig | None = None  # DeepSeek-V3.2 only
    v4: V4Config | None = None  # DeepSeek-V4 only (engine/config/deepseek_v4.py)
    fp8: Fp8Format | None = None  # block-scaled FP8 weights (quantization_config)

    def routed_experts(self) -> RoutedExperts | None:
        """The routed experts' layout; None for a model without them."""
        if self.v4 is not None:
            hashed = [i for i, kind in enumerate(self.v4.mlp_layer_types) if kind == HASH_MOE]
            n = self.num_hidden_layers + self.num_mtp_layers  # MTP modules: top-k MoE
            return RoutedExperts(n, self.v4.num_experts, 1, tuple(hashed))
        if self.moe is None:
            return None
        dense = self.moe.first_k_dense_replace
        layers = max(0, self.num_hidden_layers - dense) + self.num_mtp_layers
        return RoutedExperts(layers, self.moe.num_experts, self.moe.num_groups)

    @classmethod
    def from_pretrained(cls, path: Path) -> ModelConfig:
        raw = json.loads((path / "config.json").read_text())
        arch = (raw.get("architectures") or ["<none>"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r} in {path / 'config.json'}; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if arch == V4_ARCHITECTURE:
            return cls._deepseek_v4(path, raw)
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}; supported: silu")
        if raw.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported")
        heads = raw["num_attention_heads"]
        rope_scaling = raw.get("rope_scaling") or raw.get("rope_parameters")
        deepseek = arch in ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
        dsa = _dsa(raw, arch)
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
            mla=_mla(raw, dsa is not None) if deepseek else None,
            moe=_moe(raw) if deepseek else None,
            num_mtp_layers=_mtp_layers(path, raw, "model.layers.{n}.") if deepseek else 0,
            dsa=dsa,
            fp8=fp8_format(raw),
        )

    @classmethod
    def _deepseek_v4(cls, path: Path, raw: dict) -> ModelConfig:
        """The common fields from V4's config.json; the rest go to ``v4``."""
        v4 = parse_v4(raw)
        return cls(
            architecture=V4_ARCHITECTURE,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=v4.moe_intermediate_size,
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=raw["num_attention_heads"],
            num_key_value_heads=1,
            head_dim=v4.head_dim,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=v4.main_rope.theta,
            rope_scaling=None,
            max_position_embeddings=raw.get("max_position_embeddings", 1048576),
            tie_word_embeddings=False,
            attention_bias=False,
            qk_norm=False,
            eos_token_ids=_eos_ids(path, raw),
            # DeepSeek ships one MTP module; a second would need a layer config of its own
            num_mtp_layers=min(1, _mtp_layers(path, raw, "mtp.0.", "model.mtp.0.")),
            v4=v4,
            fp8=fp8_format(raw),
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


def _mla(raw: dict, sparse: bool) -> MLAConfig:
    """V3.2 (``sparse``) has no rope_interleave field: its MLA is always interleaved."""
    return MLAConfig(
        q_lora_rank=_deepseek(raw, "q_lora_rank"),
        kv_lora_rank=raw["kv_lora_rank"],
        qk_nope_head_dim=raw["qk_nope_head_dim"],
        qk_rope_head_dim=raw["qk_rope_head_dim"],
        v_head_dim=raw["v_head_dim"],
        rope_interleave=True if sparse else _deepseek(raw, "rope_interleave"),
    )


# What transformers' DeepseekV32Config reads for a DSA field config.json leaves out.
DSA_DEFAULTS = {"index_topk": 2048, "index_n_heads": 64, "index_head_dim": 128}


def _dsa(raw: dict, arch: str) -> DSAConfig | None:
    """The indexer's settings, for V3.2 alone: on any other architecture a DSA field
    would be ignored and the model run dense, so it is an error instead. V3.2's MTP
    module is a V3.2 layer, indexer and all (models/deepseek_v32.py)."""
    if arch != "DeepseekV32ForCausalLM":
        named = sorted(set(DSA_DEFAULTS) & set(raw))
        if named:
            raise ValueError(
                f"{named[0]} is set in config.json, but {arch} has no lightning indexer; "
                "DeepSeek sparse attention needs a DeepseekV32ForCausalLM checkpoint"
            )
        return None
    dsa = DSAConfig(*(int(raw.get(name, default)) for name, default in DSA_DEFAULTS.items()))
    if _deepseek(raw, "q_lora_rank") is None:
        raise ValueError("q_lora_rank is null: DeepseekV32ForCausalLM's indexer reads q_a_proj")
    for name in DSA_DEFAULTS:
        if getattr(dsa, name) < 1:
            raise ValueError(f"{name} must be at least 1, got {getattr(dsa, name)}")
    if dsa.index_head_dim < raw["qk_rope_head_dim"]:
        raise ValueError(
            f"index_head_dim {dsa.index_head_dim} is smaller than qk_rope_head_dim "
            f"{raw['qk_rope_head_dim']}, the part of it that RoPE rotates"
        )
    dense = min(_deepseek(raw, "first_k_dense_replace"), raw["num_hidden_layers"])
    pattern = ["dense"] * dense + ["sparse"] * (raw["num_hidden_layers"] - dense)
    if raw.get("mlp_layer_types", pattern) != pattern:
        raise ValueError(
            f"mlp_layer_types {raw['mlp_layer_types']} is not first_k_dense_replace={dense} "
            "dense layers then MoE layers, the only pattern the engine builds"
        )
    return dsa


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


def _mtp_layers(path: Path, raw: dict, *first: str) -> int:
    """The MTP modules the checkpoint holds, found by the names ``first`` of the
    first module's tensors ({n}: num_hidden_layers). transformers' DeepseekV3Config
    and DeepseekV4Config say num_nextn_predict_layers=1 by default, but their
    models save no MTP weights: such a checkpoint is served without MTP, and the
    log says so."""
    wanted = raw.get("num_nextn_predict_layers", 0)
    if wanted == 0:
        return 0
    prefixes = tuple(f.format(n=raw["num_hidden_layers"]) for f in first)
    if any(name.startswith(prefixes) for name in tensor_names(path)):
        return wanted
    logger.warning(
        "DeepInfer: %s declares %d MTP layer(s) but holds no MTP weights (as transformers "
        "saves DeepSeek-V3 and V4); serving it without MTP",
        path,
        wanted,
    )
    return 0


def tensor_names(path: Path) -> list[str]:
    """Every tensor name in a checkpoint folder, from the safetensors index or the
    files' headers (8 bytes of header length, then JSON), reading no tensor."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return list(json.loads(index.read_text())["weight_map"])
    names: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            names += [n for n in json.loads(f.read(size)) if n != "__metadata__"]
    return names
