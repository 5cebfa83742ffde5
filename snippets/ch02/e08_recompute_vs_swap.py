"""Experiment 8: preemption by recompute or by swap, and where they break even.

When the KV pool runs out, the scheduler preempts a request and takes its
blocks. To resume it later there are two ways to get its KV cache back:

  recompute: run the request's context through the model again (a prefill),
             2 FLOPs per parameter per token plus attention, which grows with
             the square of the context;
  swap:      copy its KV blocks to host memory over PCIe, and back again,
             2 x context x KV bytes per token.

Both costs are times at a stated rate, for two models from published configs.
The rates are published peaks, and it is an assumption that either is reached.
"""

# Published, not measured. Assumed to be reached, which neither is in practice.
PREFILL_FLOP_PER_S = 989e12  # H200 SXM dense BF16 (NVIDIA), as in Experiment 2
PCIE_BYTES_PER_S = 64e9  # PCIe Gen5 x16, per direction (PCI-SIG: 32 GT/s per lane)

# name: parameters (published model size), attention width (heads x head_dim),
# layers, and KV bytes per token in bf16 (layers x KV heads x head_dim x 2 x 2),
# from each model's config.json on Hugging Face.
MODELS = {
    # Qwen/Qwen3-0.6B: 28 layers, 16 query heads, 8 KV heads, head_dim 128.
    "Qwen3-0.6B": (0.6e9, 16 * 128, 28, 28 * 8 * 128 * 2 * 2),
    # meta-llama/Meta-Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128.
    "Llama-3-8B": (8.0e9, 32 * 128, 32, 32 * 8 * 128 * 2 * 2),
}
CONTEXTS = [1024, 4096, 16384, 32768, 65536]


def recompute_s(model: str, context: int, flop_rate: float = PREFILL_FLOP_PER_S) -> float:
    params, width, layers, _ = MODELS[model]
    linear = 2 * params * context
    attention = 2 * width * layers * context**2  # QK^T and AV over a causal mask
    return (linear + attention) / flop_rate


def swap_s(model: str, context: int, pcie: float = PCIE_BYTES_PER_S) -> float:
    """Out to host memory and back in again."""
    return 2 * context * MODELS[model][3] / pcie


def break_even(
    model: str, flop_rate: float = PREFILL_FLOP_PER_S, pcie: float = PCIE_BYTES_PER_S
) -> int | None:
    """The context above which swapping is cheaper, or None if it always is."""
    params, width, layers, kv = MODELS[model]
    tokens = (kv * flop_rate / pcie - params) / (width * layers)
    return int(tokens) + 1 if tokens > 0 else None


def main() -> None:
    print("assumed rates (published peaks): prefill 989 TFLOP/s (H200 dense BF16),")
    print("PCIe 64 GB/s per direction (Gen5 x16); swap = out + back in")
    for name, (params, _, layers, kv) in MODELS.items():
        print(
            f"{name}: {params / 1e9:.1f}e9 parameters, {layers} layers, {kv:,} KV bytes per token"
        )
    print()
    print(f"{'context':>7} " + " ".join(f"{m + ' recompute':>21} {'swap':>8}" for m in MODELS))
    for context in CONTEXTS:
        cells = " ".join(
            f"{recompute_s(m, context) * 1e3:>18,.1f} ms {swap_s(m, context) * 1e3:>5.1f} ms"
            for m in MODELS
        )
        print(f"{context:>7,} {cells}")
    print()
    cases = [
        ("at the assumed rates", PREFILL_FLOP_PER_S, PCIE_BYTES_PER_S),
        ("if prefill reaches half the peak", PREFILL_FLOP_PER_S / 2, PCIE_BYTES_PER_S),
        ("if PCIe reaches half its rate", PREFILL_FLOP_PER_S, PCIE_BYTES_PER_S / 2),
    ]
    for label, flops, pcie in cases:
        print(f"break-even {label}:")
        for model in MODELS:
            tokens = break_even(model, flops, pcie)
            verdict = (
                f"recompute below {tokens:,} tokens, swap above"
                if tokens
                else "swap at every length"
            )
            print(f"  {model:<11} {verdict}")


if __name__ == "__main__":
    main()
