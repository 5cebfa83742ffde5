"""Experiment 3: KV-cache bytes per token for MHA, GQA and MLA, from published configs.

Every layer caches something for every token it has seen. Multi-head attention
(MHA) keeps a key and a value per head; grouped-query attention (GQA) keeps
them only for a few shared KV heads; multi-head latent attention (MLA) keeps
one compressed latent vector plus a small positional key, shared by all heads.
The numbers below are the models' own config.json values on Hugging Face; the
rows marked "if MHA" are counterfactuals computed from the same configs.
"""

BYTES_PER_VALUE = 2  # bf16
CONTEXT = 32 * 1024  # tokens in one long context

# Each entry: name, source, attention kind, layers, values cached per token per layer.
MODELS = [
    # meta-llama/Meta-Llama-3-8B config.json: num_hidden_layers 32, num_attention_heads 32,
    # num_key_value_heads 8, hidden_size 4096 (head_dim 4096 / 32 = 128).
    ("Llama-3-8B", "meta-llama/Meta-Llama-3-8B", "GQA", 32, 2 * 8 * 128),
    ("Llama-3-8B if MHA", "same, 32 KV heads", "MHA", 32, 2 * 32 * 128),
    # Qwen/Qwen3-8B config.json: num_hidden_layers 36, num_attention_heads 32,
    # num_key_value_heads 8, head_dim 128.
    ("Qwen3-8B", "Qwen/Qwen3-8B", "GQA", 36, 2 * 8 * 128),
    # deepseek-ai/DeepSeek-V3 config.json: num_hidden_layers 61, kv_lora_rank 512,
    # qk_rope_head_dim 64 (one latent of 512 plus one shared RoPE key of 64 per token).
    ("DeepSeek-V3", "deepseek-ai/DeepSeek-V3", "MLA", 61, 512 + 64),
    # Same config: num_attention_heads 128, keys of qk_nope_head_dim 128 + qk_rope_head_dim 64,
    # values of v_head_dim 128, if every head cached its own key and value.
    ("DeepSeek-V3 if MHA", "same, 128 full heads", "MHA", 61, 128 * (128 + 64 + 128)),
]


def bytes_per_token(layers: int, values_per_layer: int) -> int:
    return layers * values_per_layer * BYTES_PER_VALUE


def main() -> None:
    print("KV cache per token in bf16, from each model's config.json on Hugging Face")
    print()
    print(
        f"{'model':<19} {'kind':<4} {'layers':>6} {'values/layer':>12} "
        f"{'bytes/token':>12} {'KiB':>8} {'GiB @32k':>9}"
    )
    for name, _, kind, layers, values in MODELS:
        size = bytes_per_token(layers, values)
        print(
            f"{name:<19} {kind:<4} {layers:>6} {values:>12,} {size:>12,} "
            f"{size / 1024:>8,.1f} {size * CONTEXT / 2**30:>9.2f}"
        )
    print()
    print("sources (config.json on huggingface.co):")
    for name, source, *_ in MODELS:
        print(f"  {name:<19} {source}")
    print()
    gqa, mha = (bytes_per_token(m[3], m[4]) for m in MODELS[:2])
    mla, full = (bytes_per_token(m[3], m[4]) for m in MODELS[3:])
    print(f"GQA with 8 KV heads instead of 32 saves a factor of {mha / gqa:.0f} on Llama-3-8B")
    print(f"MLA's latent is {full / mla:.0f} times smaller than full heads on DeepSeek-V3")
    print(f"DeepSeek-V3 caches {mla / gqa:.2f} times what Llama-3-8B caches per token")


if __name__ == "__main__":
    main()
