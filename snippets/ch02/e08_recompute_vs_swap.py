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

from __future__ import annotations

# Published, not measured. Assumed to be reached, which neither is in practice.
GPU = "H200 SXM"
PREFILL_FLOP_PER_S = 989e12  # H200 SXM dense BF16, as in Experiment 2 (1,979 with sparsity)
LINK = "PCIe Gen5 x16"
PCIE_BYTES_PER_S = 64e9  # PCIe Gen5 x16, per direction (PCI-SIG: 32 GT/s per lane)

# name: parameters (published model size), attention width (heads x head_dim),
# layers, and KV bytes per token in bf16 (layers x KV heads x head_dim x 2 x 2),
# from each model's config.json on Hugging Face.
MODELS = {
    # Qwen/Qwen3-0.6B: 28 layers, 16 query heads, 8 KV heads, head_dim 128.
    "Qwen3-0.6B": (0.6e9, 16 * 128, 28, 28 * 8 * 128 * 2 * 2),
    # meta-llama/Llama-3.1-8B: 32 layers, 32 query heads, 8 KV heads, head_dim 128.
    "Llama-3.1-8B": (8.0e9, 32 * 128, 32, 32 * 8 * 128 * 2 * 2),
}
SLUGS = {"Qwen3-0.6B": "qwen", "Llama-3.1-8B": "llama"}  # result names
CONTEXTS = [1024, 4096, 16384, 32768, 65536]
PROBE_CONTEXT = 4096  # a context the chapter asks about


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


def main() -> dict:
    print("assumed rates (published peaks):")
    print(f"  prefill {PREFILL_FLOP_PER_S / 1e12:.0f} TFLOP/s ({GPU}, dense BF16)")
    print(f"  {LINK}: {PCIE_BYTES_PER_S / 1e9:.0f} GB/s per direction")
    print("  swap = out to host memory and back in")
    results: dict = {}
    for name, (params, _, layers, kv) in MODELS.items():
        print(f"{name}: {params / 1e9:.1f}B parameters, {layers} layers,")
        print(f"  {kv:,} KV bytes per token")
        slug = SLUGS[name]
        results.update({f"{slug}_params_billion": params / 1e9, f"{slug}_kv_bytes": kv})
        # Per token, before attention: 2P FLOPs to recompute, 2K bytes to swap.
        results[f"{slug}_recompute_us_per_token"] = 2 * params / PREFILL_FLOP_PER_S * 1e6
        results[f"{slug}_swap_us_per_token"] = 2 * kv / PCIE_BYTES_PER_S * 1e6
    print()
    print((f"{'':>7}" + "".join(f"{m:^21}" for m in MODELS)).rstrip())
    print(f"{'context':>7}" + f"{'recompute':>12}{'swap':>9}" * len(MODELS))
    for context in CONTEXTS:
        cells = ""
        for m in MODELS:
            recompute, swap = recompute_s(m, context) * 1e3, swap_s(m, context) * 1e3
            cells += f"{recompute:>9,.1f} ms{swap:>6.1f} ms"
            results[f"{SLUGS[m]}_recompute_ms_{context}"] = recompute
            results[f"{SLUGS[m]}_swap_ms_{context}"] = swap
        print(f"{context:>7,}{cells}")
    print("(ms to bring one request's context back)")
    print()
    cases = [
        ("at the assumed rates", "", PREFILL_FLOP_PER_S, PCIE_BYTES_PER_S),
        (
            "if prefill reaches half the peak",
            "_half_prefill",
            PREFILL_FLOP_PER_S / 2,
            PCIE_BYTES_PER_S,
        ),
        ("if PCIe reaches half its rate", "_half_pcie", PREFILL_FLOP_PER_S, PCIE_BYTES_PER_S / 2),
    ]
    for label, suffix, flops, pcie in cases:
        print(f"break-even {label}:")
        for model in MODELS:
            tokens = break_even(model, flops, pcie)
            verdict = f"recompute below {tokens:,} tokens" if tokens else "swap at every length"
            print(f"  {model:<12} {verdict}")
            if tokens:
                results[f"{SLUGS[model]}_break_even{suffix}"] = tokens
            results[f"{SLUGS[model]}_verdict{suffix}"] = verdict
    return {
        "gpu": GPU,
        "prefill_tflop_per_s": PREFILL_FLOP_PER_S / 1e12,
        "link": LINK,
        "pcie_gb_per_s": PCIE_BYTES_PER_S / 1e9,
        "probe_context": PROBE_CONTEXT,
        **results,
    }


if __name__ == "__main__":
    main()
