"""Experiment 4: where attention reads overtake weight reads as contexts grow.

A decode step reads the weights once for the whole batch, but it reads every
request's cached keys and values: batch x context x KV bytes per token. The
weights' share is fixed; the KV share grows with both the batch and the
context. This finds the context at which the KV reads become the larger part.

The model is the Llama-3.1-8B of Experiments 2 and 3: 8.0e9 parameters in bf16
(16 GB of weights) and 131,072 KV bytes per token (32 layers x 8 KV heads x
head_dim 128 x key and value x 2 bytes, from its config.json). Llama-3.1 has a
context window of 128k tokens, so every context below fits it. Every request in
the batch is assumed to hold the same context length.
"""

from __future__ import annotations

import math

MODEL = "Llama-3.1-8B"
WEIGHT_BYTES = 8.0e9 * 2  # 8.0e9 parameters in bf16
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head_dim x (K, V) x bf16
# Published H200 SXM figures (NVIDIA), as in Experiment 2; not measured.
GPU = "H200"
HBM_BYTES_PER_S = 4.8e12  # 4.8 TB/s
HBM_CAPACITY = 141e9  # 141 GB

BATCHES = [1, 8, 32, 64, 128, 256]
CONTEXTS = [1024, 4096, 16384, 65536]
PROBE_BATCH = 32  # the batch worked out in full...
PROBE_CONTEXTS = {"short": 1024, "long": 16384}  # ...at these contexts


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


def step_seconds(batch: int, context: int) -> float:
    """Every byte read once, at the published bandwidth."""
    return sum(step_bytes(batch, context)) / HBM_BYTES_PER_S


def main() -> dict:
    print(f"{MODEL}: {WEIGHT_BYTES / 1e9:.0f} GB of weights read per step,")
    print(f"  {KV_BYTES_PER_TOKEN:,} KV bytes per token of context")
    print()
    print("KV share of the bytes one decode step reads")
    print(f"{'':>5}{'context (tokens)':^28}{'KV > weights':>15}")
    labels = "".join(f"{f'{c // 1024}k':>6} " for c in CONTEXTS)
    print(f"{'batch'}{labels}{'from (tokens)':>15}")
    for batch in BATCHES:
        cells = "".join(
            f"{kv_share(batch, c):>6.0%}{' ' if fits(batch, c) else '*'}" for c in CONTEXTS
        )
        print(f"{batch:>5}{cells} {crossover_context(batch):>15,}")
    print(f"* weights and KV together exceed the {GPU}'s {HBM_CAPACITY / 1e9:.0f} GB")
    print()
    results: dict = {}
    batch = PROBE_BATCH
    step = WEIGHT_BYTES / HBM_BYTES_PER_S
    print(f"batch {batch}, weights alone:")
    print(f"  {step * 1e3:.1f} ms a step, {batch / step:,.0f} tokens/s")
    results[f"weights_only_ms_batch_{batch}"] = step * 1e3
    results[f"weights_only_tokens_per_s_batch_{batch}"] = batch / step
    for name, context in PROBE_CONTEXTS.items():
        results[f"probe_{name}_context"] = context
        weights, kv = step_bytes(batch, context)
        step = step_seconds(batch, context)
        print(f"batch {batch}, {context:,} tokens each:")
        print(f"  {weights / 1e9:.0f} GB weights + {kv / 1e9:.1f} GB KV,")
        print(f"  {step * 1e3:.1f} ms a step, {batch / step:,.0f} tokens/s")
        key = f"batch_{batch}_context_{context}"
        results[f"kv_gb_{key}"] = kv / 1e9
        results[f"step_ms_{key}"] = step * 1e3
        results[f"tokens_per_s_{key}"] = batch / step
    for batch in BATCHES:
        results[f"crossover_batch_{batch}"] = crossover_context(batch)
    return {
        "model": MODEL,
        "weight_gb": WEIGHT_BYTES / 1e9,
        "kv_bytes_per_token": KV_BYTES_PER_TOKEN,
        "hbm_capacity_gb": HBM_CAPACITY / 1e9,
        "probe_batch": PROBE_BATCH,
        **results,
    }


if __name__ == "__main__":
    main()
