"""What a DeepSeek-V4 config.json says, read as transformers' DeepseekV4Config reads it.

V4 names its parts in fields of its own: three attention layer types (a sliding
window alone, or with compressed rows beside it at one of two rates), two MoE
router types, the hyper-connections' stream count, and two RoPE bases. The
legacy spellings DeepSeek's own configs use (compress_ratios, num_hash_layers,
qk_rope_head_dim) are folded in as transformers folds them. A value the engine
does not implement is refused here, naming its field. Its quantized weights
(FP8 layers, FP4 experts) are read by fp8_format.py, as every model's are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
RATE_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}  # DeepSeek's compress_ratios
DEFAULT_RATES = {CSA: 4, HCA: 128}
SCORING = ("sqrtsoftplus", "sigmoid")
# Fields the engine implements one value of; another would run wrongly.
FIXED = {
    "hidden_act": "silu",
    "num_key_value_heads": 1,
    "attention_bias": False,
    "mlp_bias": False,
    "norm_topk_prob": True,  # transformers normalises the top-k weights whatever it says
    "n_shared_experts": 1,  # transformers builds one shared expert whatever it says
    "tie_word_embeddings": False,
}


@dataclass(frozen=True)
class RopeSpec:
    """One of V4's two rotary embeddings: its base, and YaRN's settings or None."""

    theta: float
    yarn: dict | None


@dataclass(frozen=True)
class V4Config:
    head_dim: int  # of each query head, and of the one shared K=V head
    rope_dim: int  # the trailing part of a head that RoPE rotates
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    main_rope: RopeSpec  # sliding-window layers
    compress_rope: RopeSpec  # CSA and HCA layers, their compressors and the indexer
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    swiglu_limit: float
    scoring_func: str
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    routed_scaling_factor: float

    def with_mtp_layer(self) -> V4Config:
        """This config with one more layer, an MTP module's: DeepSeek's release gives
        it compress ratio 0 (a sliding window alone) and top-k routing."""
        return replace(
            self,
            layer_types=(*self.layer_types, SLIDING),
            mlp_layer_types=(*self.mlp_layer_types, TOPK_MOE),
        )

    def token_widths(self, layer: int) -> tuple[int, int, int]:
        """Numbers a layer caches per token (engine/kv/compressed_cache.py): its K = V
        row; its compressor's kv and gate, each twice head_dim wide under CSA's
        overlapping units (compressor.py); the indexer's compressor's, likewise."""
        kind = self.layer_types[layer]
        lanes = 2 if kind == CSA else 1
        state = 0 if kind == SLIDING else 2 * lanes * self.head_dim
        index_state = 2 * 2 * self.index_head_dim if kind == CSA else 0
        return self.head_dim, state, index_state

    def row_widths(self, layer: int) -> tuple[int, int]:
        """Numbers per compressed row: the row, and under CSA the indexer's key."""
        kind = self.layer_types[layer]
        if kind == SLIDING:
            return 0, 0
        return self.head_dim, self.index_head_dim if kind == CSA else 0

    def row_span(self, block_size: int) -> int:
        """Tokens whose compressed rows one row block holds, in every layer: a
        multiple of the block size and of every rate (so each row block holds
        whole rows at each rate, and ends where a token block ends), as many as
        fit in a block's room for ``block_size`` tokens, and at least one such
        multiple. 0 with no compressed layer."""
        layers = range(len(self.layer_types))
        rates = [self.rate(i) for i in layers if self.rate(i)]
        if not rates:
            return 0
        unit = math.lcm(block_size, *rates)
        room = block_size * sum(sum(self.token_widths(i)) for i in layers)
        per_unit = sum(
            sum(self.row_widths(i)) * (unit // self.rate(i)) for i in layers if self.rate(i)
        )
        return unit * max(1, room // per_unit)

    def window_tokens(self) -> int:
        """The last tokens whose blocks a request must keep: the attention window,
        and the compressor's states of a window not yet closed (with CSA's overlap,
        of the window before it too)."""
        spans = [self.sliding_window]
        for kind in set(self.layer_types) - {SLIDING}:
            spans.append(self.compress_rates[kind] * (2 if kind == CSA else 1))
        return max(spans)

    def rate(self, layer: int) -> int:
        """Tokens per compressed row in this layer; 0 for a sliding-window layer."""
        kind = self.layer_types[layer]
        return 0 if kind == SLIDING else self.compress_rates[kind]


def parse_v4(raw: dict) -> V4Config:
    """V4's own fields, checked; ValueError naming the field for anything unsupported."""
    _check_fixed(raw)
    n, head_dim = raw["num_hidden_layers"], raw.get("head_dim", 512)
    rope_dim = _rope_dim(raw, head_dim)
    scoring = raw.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING:
        raise ValueError(
            f"unsupported scoring_func {scoring!r} in config.json; supported: {SCORING}"
        )
    main, compress = _ropes(raw)
    cfg = V4Config(
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=raw.get("q_lora_rank", 1024),
        o_groups=raw.get("o_groups", 8),
        o_lora_rank=raw.get("o_lora_rank", 1024),
        sliding_window=raw.get("sliding_window", 128),
        layer_types=_layer_types(raw, n),
        compress_rates={**DEFAULT_RATES, **(raw.get("compress_rates") or {})},
        main_rope=main,
        compress_rope=compress,
        index_n_heads=raw.get("index_n_heads", 64),
        index_head_dim=raw.get("index_head_dim", 128),
        index_topk=raw.get("index_topk", 512),
        hc_mult=raw.get("hc_mult", 4),
        hc_sinkhorn_iters=raw.get("hc_sinkhorn_iters", 20),
        hc_eps=raw.get("hc_eps", 1e-6),
        mlp_layer_types=_mlp_layer_types(raw, n),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        scoring_func=scoring,
        num_experts=raw.get("n_routed_experts", 256),
        top_k=raw.get("num_experts_per_tok", 6),
        moe_intermediate_size=raw.get("moe_intermediate_size", 2048),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
    )
    _check_shapes(raw, cfg)
    return cfg


def _check_fixed(raw: dict) -> None:
    for name, supported in FIXED.items():
        if raw.get(name, supported) != supported:
            raise ValueError(
                f"unsupported {name} {raw[name]!r} in config.json for DeepSeek-V4; "
                f"supported: {supported!r}"
            )


def _rope_dim(raw: dict, head_dim: int) -> int:
    if raw.get("partial_rotary_factor") is not None:
        return int(head_dim * raw["partial_rotary_factor"])
    return int(raw.get("qk_rope_head_dim", head_dim * 64 // 512))


def _ropes(raw: dict) -> tuple[RopeSpec, RopeSpec]:
    """main: plain RoPE at rope_theta; compress: compress_rope_theta, maybe YaRN,
    with cos and sin never scaled (transformers forces attention_factor 1)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    nested = isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict)
    main = params["main"] if nested else {"rope_theta": raw.get("rope_theta", 10000.0)}
    if main.get("rope_type", "default") != "default":
        raise ValueError(
            f"unsupported rope_parameters.main.rope_type {main['rope_type']!r}; supported: default"
        )
    compress = dict(params["compress"]) if nested else {**params}
    compress.setdefault("rope_theta", raw.get("compress_rope_theta", 160000.0))
    kind = compress.get("rope_type") or compress.get("type") or "default"
    if kind not in ("default", "yarn"):
        raise ValueError(
            f"unsupported rope_parameters.compress.rope_type {kind!r}; supported: default, yarn"
        )
    yarn = None
    if kind == "yarn":
        yarn = {**compress, "rope_type": "yarn"}
        yarn.setdefault("attention_factor", 1.0)
        if yarn["attention_factor"] != 1.0:
            raise ValueError(
                "rope_parameters.compress.attention_factor must be 1.0 for DeepSeek-V4"
            )
    return RopeSpec(float(main["rope_theta"]), None), RopeSpec(float(compress["rope_theta"]), yarn)


def _layer_types(raw: dict, n: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        bad = [r for r in raw["compress_ratios"] if r not in RATE_TO_TYPE]
        if bad:
            raise ValueError(f"unsupported compress_ratios entries {bad}; supported: 0, 4, 128")
        types = [RATE_TO_TYPE[r] for r in raw["compress_ratios"]]
    if types is None:
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]
    bad = sorted(set(types) - {SLIDING, CSA, HCA})
    if bad or len(types) != n:
        raise ValueError(
            f"layer_types must name {n} layers among {SLIDING}, {CSA}, {HCA}; got {types}"
        )
    return tuple(types)


def _mlp_layer_types(raw: dict, n: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        hashed = raw.get("num_hash_layers", 3)
        types = [HASH_MOE] * min(n, hashed) + [TOPK_MOE] * max(0, n - hashed)
    types = list(types)[:n]
    bad = sorted(set(types) - {HASH_MOE, TOPK_MOE})
    if bad or len(types) != n:
        raise ValueError(f"mlp_layer_types must name {n} layers among hash_moe, moe; got {types}")
    return tuple(types)


def _check_shapes(raw: dict, cfg: V4Config) -> None:
    heads = raw["num_attention_heads"]
    if cfg.rope_dim % 2 or not 0 < cfg.rope_dim <= min(cfg.head_dim, cfg.index_head_dim):
        raise ValueError(
            f"partial_rotary_factor gives a rope dim of {cfg.rope_dim}: it must be even, and "
            f"at most head_dim {cfg.head_dim} and index_head_dim {cfg.index_head_dim}"
        )
    if heads * cfg.head_dim % cfg.o_groups:
        raise ValueError(f"o_groups {cfg.o_groups} does not divide the heads' output width")
    for kind, rate in cfg.compress_rates.items():
        if rate < 1:
            raise ValueError(f"compress_rates[{kind!r}] must be at least 1, got {rate}")
    if cfg.hc_mult < 1 or cfg.hc_sinkhorn_iters < 1:
        raise ValueError("hc_mult and hc_sinkhorn_iters must be at least 1")
    if cfg.top_k > cfg.num_experts:
        raise ValueError("num_experts_per_tok exceeds n_routed_experts")
