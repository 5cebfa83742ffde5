"""Experiment 3: KV-cache bytes per token for MHA, GQA and MLA, from published configs.

Every layer caches something for every token it has seen. Multi-head attention
(MHA) keeps a key and a value per head; grouped-query attention (GQA) keeps
them only for a few shared KV heads; multi-head latent attention (MLA) keeps
one compressed latent vector plus a small positional key, shared by all heads.
The numbers below are the models' own config.json values on Hugging Face; the
rows marked "MHA" under a model are counterfactuals computed from the same
configs.
"""

from __future__ import annotations

DTYPE, BYTES_PER_VALUE = "bf16", 2
CONTEXT = 32 * 1024  # tokens in one long context

# The config.json fields the cache depends on, from each model's repository on
# Hugging Face. Llama-3.1-8B sets hidden_size 4096, so head_dim is 4096 / 32.
LLAMA = dict(
    name="Llama-3.1-8B",
    repo="meta-llama/Llama-3.1-8B",
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
QWEN = dict(
    name="Qwen3-8B",
    repo="Qwen/Qwen3-8B",
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
)
DEEPSEEK = dict(
    name="DeepSeek-V3",
    repo="deepseek-ai/DeepSeek-V3",
    num_hidden_layers=61,
    num_attention_heads=128,
    kv_lora_rank=512,  # the compressed latent MLA caches
    qk_rope_head_dim=64,  # the one RoPE key shared by all heads
    qk_nope_head_dim=128,  # per head, if keys were cached whole...
    v_head_dim=128,  # ...and values too
)


def gqa(cfg: dict, kv_heads: int) -> int:
    """Values per token per layer: a key and a value for each KV head."""
    return 2 * kv_heads * cfg["head_dim"]


def mla(cfg: dict) -> int:
    """One latent plus one RoPE key, shared by all heads."""
    return cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]


def mla_as_mha(cfg: dict) -> int:
    """Every head caching its own whole key (no-RoPE and RoPE parts) and value."""
    key = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    return cfg["num_attention_heads"] * (key + cfg["v_head_dim"])


# name, source, attention kind, layers, values cached per token per layer
ROWS = [
    (LLAMA["name"], LLAMA["repo"], "GQA", LLAMA, gqa(LLAMA, LLAMA["num_key_value_heads"])),
    (
        "  if MHA",
        f"same, {LLAMA['num_attention_heads']} KV heads",
        "MHA",
        LLAMA,
        gqa(LLAMA, LLAMA["num_attention_heads"]),
    ),
    (QWEN["name"], QWEN["repo"], "GQA", QWEN, gqa(QWEN, QWEN["num_key_value_heads"])),
    (DEEPSEEK["name"], DEEPSEEK["repo"], "MLA", DEEPSEEK, mla(DEEPSEEK)),
    (
        "  if MHA",
        f"same, {DEEPSEEK['num_attention_heads']} full heads",
        "MHA",
        DEEPSEEK,
        mla_as_mha(DEEPSEEK),
    ),
]


def bytes_per_token(cfg: dict, values_per_layer: int) -> int:
    return cfg["num_hidden_layers"] * values_per_layer * BYTES_PER_VALUE


def main() -> dict:
    ctx = f"{CONTEXT // 1024}k"
    print(f"KV cache per token in {DTYPE},")
    print("  from config.json on Hugging Face")
    print()
    print(f"{'model':<13} {'kind':<4} {'layers':>6} {'values':>7} {'bytes':>9} {'GiB at':>8}")
    print(f"{'':<13} {'':<4} {'':>6} {'/layer':>7} {'/token':>9} {ctx + ' ctx':>8}")
    sizes = []
    for name, _, kind, cfg, values in ROWS:
        size = bytes_per_token(cfg, values)
        sizes.append(size)
        layers = cfg["num_hidden_layers"]
        gib = size * CONTEXT / 2**30
        print(f"{name:<13} {kind:<4} {layers:>6} {values:>7,} {size:>9,} {gib:>8.2f}")
    print()
    print("sources (config.json on huggingface.co):")
    for name, source, *_ in ROWS:
        print(f"  {name:<13} {source}")
    print()
    llama_gqa, llama_mha, qwen, ds_mla, ds_mha = sizes
    heads, kv_heads = LLAMA["num_attention_heads"], LLAMA["num_key_value_heads"]
    print(f"{LLAMA['name']}: GQA, {kv_heads} KV heads instead of {heads},")
    print(f"  caches {llama_mha / llama_gqa:.0f} times less")
    print(f"{DEEPSEEK['name']}: MLA caches {ds_mha / ds_mla:.0f} times less than full heads")
    print(f"{DEEPSEEK['name']} caches {ds_mla / llama_gqa:.2f} times")
    print(f"  what {LLAMA['name']} caches per token")
    gib = {n: s * CONTEXT / 2**30 for n, s in (("llama", llama_gqa), ("deepseek", ds_mla))}
    return {
        "dtype": DTYPE,
        "context": CONTEXT,
        "context_k": CONTEXT // 1024,
        "llama": LLAMA["name"],
        "llama_layers": LLAMA["num_hidden_layers"],
        "llama_heads": heads,
        "llama_kv_heads": kv_heads,
        "llama_head_dim": LLAMA["head_dim"],
        "llama_bytes": llama_gqa,
        "llama_kib": llama_gqa / 1024,
        "llama_mha_kib": llama_mha / 1024,
        "gqa_saving": llama_mha / llama_gqa,
        "qwen_layers": QWEN["num_hidden_layers"],
        "qwen_kib": qwen / 1024,
        "deepseek_layers": DEEPSEEK["num_hidden_layers"],
        "deepseek_heads": DEEPSEEK["num_attention_heads"],
        "deepseek_values_per_layer": mla(DEEPSEEK),
        "deepseek_bytes": ds_mla,
        "mla_saving": ds_mha / ds_mla,
        "deepseek_over_llama": ds_mla / llama_gqa,
        "llama_gib_at_context": gib["llama"],
        "deepseek_gib_at_context": gib["deepseek"],
    }


if __name__ == "__main__":
    main()
