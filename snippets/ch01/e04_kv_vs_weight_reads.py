"""Experiment 4: where attention reads overtake weight reads as contexts grow.

A decode step reads the weights once for the whole batch, but it reads every
request's cached keys and values: batch x context x KV bytes per token. The
weights' share is fixed; the KV share grows with both the batch and the
context. This finds the context at which the KV reads become the larger part.

The model is the Llama-3-8B of Experiments 2 and 3: 8.0e9 parameters in bf16
(16 GB of weights) and 131,072 KV bytes per token (32 layers x 8 KV heads x
head_dim 128 x key and value x 2 bytes, from its config.json). Every request in
the batch is assumed to hold the same context length.
"""

import math

WEIGHT_BYTES = 8.0e9 * 2  # 8.0e9 parameters in bf16
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
# Published H200 SXM figures (NVIDIA), as in Experiment 2; not measured.
HBM_BYTES_PER_S = 4.8e12  # 4.8 TB/s
HBM_CAPACITY = 141e9  # 141 GB

BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [1024, 4096, 16384, 65536]


def step_bytes(batch: int, context: int) -> tuple[float, float]:
    """Bytes of weights and bytes of KV cache one decode step reads."""
    return WEIGHT_BYTES, batch * context * KV_BYTES_PER_TOKEN


def kv_share(batch: int, context: int) -> float:
    weights, kv = step_bytes(batch, context)
    return kv / (weights + kv)


def fits(batch: int, context: int) -> bool:
    return sum(step_bytes(batch, context)) <= HBM_CAPACITY


def crossover_context(batch: int) -> int:
    """The shortest context at which the batch's KV reads exceed the weight reads."""
    return math.floor(WEIGHT_BYTES / (batch * KV_BYTES_PER_TOKEN)) + 1


def main() -> None:
    print(
        f"weights: {WEIGHT_BYTES / 1e9:.0f} GB per step; KV cache: {KV_BYTES_PER_TOKEN:,} bytes per token"
    )
    print()
    print("KV share of the bytes one decode step reads")
    print(
        f"{'batch':>5} "
        + " ".join(f"{f'ctx {c:,}':>11}" for c in CONTEXTS)
        + f" {'KV > weights from':>19}"
    )
    for batch in BATCHES:
        shares = " ".join(
            f"{kv_share(batch, c):>10.0%}{' ' if fits(batch, c) else '*'}" for c in CONTEXTS
        )
        print(f"{batch:>5} {shares} {crossover_context(batch):>12,} tokens")
    print("* weights and KV cache together exceed the H200's 141 GB")
    print()
    for batch, context in [(32, 1024), (32, 16384)]:
        weights, kv = step_bytes(batch, context)
        step = (weights + kv) / HBM_BYTES_PER_S
        print(
            f"batch {batch} at {context:,} tokens: {weights / 1e9:.0f} GB weights + {kv / 1e9:.1f} GB KV"
            f" = {step * 1e3:.1f} ms per step, {batch / step:,.0f} tokens/s"
        )


if __name__ == "__main__":
    main()
