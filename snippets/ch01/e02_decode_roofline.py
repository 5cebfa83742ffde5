"""Experiment 2: a decode-step roofline. Where does batching stop paying?

One decode step runs the whole model once for every request in the batch. Its
weights are read from GPU memory once per step, however many requests share
it, while its arithmetic grows with the batch. The step takes whichever is
longer: the time to read the weights, or the time to do the multiply-adds.

The model is a dense Llama-3-8B-like model: 8.0e9 parameters in bf16, two
FLOPs (one multiply-add) per parameter per token. The hardware figures are
NVIDIA's published H200 SXM numbers, not measurements. KV-cache reads are left
out here; Experiment 4 adds them.
"""

PARAMS = 8.0e9  # Llama-3-8B-like (Meta's "8B"), dense
BYTES_PER_PARAM = 2  # bf16
# Published, not measured: NVIDIA H200 product page and datasheet (H200 SXM).
HBM_BYTES_PER_S = 4.8e12  # GPU memory bandwidth, 4.8 TB/s
PEAK_FLOP_PER_S = 989e12  # dense BF16 tensor core; the datasheet's 1,979 TFLOPS is with sparsity

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]


def step_times(batch: int) -> tuple[float, float]:
    """Seconds to read the weights once, and seconds for the batch's FLOPs."""
    memory = PARAMS * BYTES_PER_PARAM / HBM_BYTES_PER_S
    compute = 2 * PARAMS * batch / PEAK_FLOP_PER_S
    return memory, compute


def tokens_per_s(batch: int) -> float:
    """One token per request per step; the step lasts as long as its slower bound."""
    return batch / max(step_times(batch))


def ridge_batch() -> float:
    """The batch at which both bounds take equally long: FLOP/s over bytes/s, per FLOP/byte."""
    flop_per_byte_per_request = 2 * PARAMS / (PARAMS * BYTES_PER_PARAM)
    return PEAK_FLOP_PER_S / HBM_BYTES_PER_S / flop_per_byte_per_request


def main() -> None:
    print("H200 SXM, published figures (not measured): 4.8 TB/s HBM, 989 TFLOP/s dense BF16")
    print(
        f"model: {PARAMS / 1e9:.1f}e9 parameters in bf16, "
        f"{PARAMS * BYTES_PER_PARAM / 1e9:.0f} GB of weights per step"
    )
    print()
    print(
        f"{'batch':>5} {'memory ms':>10} {'compute ms':>11} {'tokens/s':>10} {'per request':>12}  bound"
    )
    for batch in BATCHES:
        memory, compute = step_times(batch)
        rate = tokens_per_s(batch)
        bound = "memory" if memory >= compute else "compute"
        print(
            f"{batch:>5} {memory * 1e3:>10.3f} {compute * 1e3:>11.3f} "
            f"{rate:>10,.0f} {rate / batch:>12.1f}  {bound}"
        )
    print()
    ridge = ridge_batch()
    print(f"ridge point of the H200: {PEAK_FLOP_PER_S / HBM_BYTES_PER_S:.0f} FLOP per byte read")
    print("a decode step does 1 FLOP per weight byte for each request in the batch")
    print(
        f"crossover: memory-bound up to batch {int(ridge)}, compute-bound from batch {int(ridge) + 1}"
    )
    print(f"ceiling: {PEAK_FLOP_PER_S / (2 * PARAMS):,.0f} tokens/s, whatever the batch")


if __name__ == "__main__":
    main()
