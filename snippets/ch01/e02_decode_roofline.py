"""Experiment 2: a decode-step roofline. Where does batching stop paying?

One decode step runs the whole model once for every request in the batch. Its
weights are read from GPU memory once per step, however many requests share
it, while its arithmetic grows with the batch. The step takes whichever is
longer: the time to read the weights, or the time to do the multiply-adds.

The model is a dense Llama-3.1-8B-like model: 8.0e9 parameters in bf16, two
FLOPs (one multiply-add) per parameter per token. That count includes the
input embedding table, which a step only indexes; the experiment counts it
anyway, and prints how large a share it is. The hardware figures are NVIDIA's
published H200 SXM numbers, not measurements. KV-cache reads are left out
here; Experiment 4 adds them.
"""

from __future__ import annotations

MODEL = "Llama-3.1-8B"
PARAMS = 8.0e9  # Meta's "8B", dense
DTYPE, BYTES_PER_PARAM = "bf16", 2
# meta-llama/Llama-3.1-8B config.json: vocab_size 128256, hidden_size 4096.
EMBEDDING_PARAMS = 128256 * 4096  # the input embedding table: looked up, not multiplied
GPU = "H200 SXM"
# Published, not measured: NVIDIA H200 product page and datasheet (H200 SXM).
HBM_BYTES_PER_S = 4.8e12  # GPU memory bandwidth, 4.8 TB/s
PEAK_FLOP_PER_S = 989e12  # dense BF16 tensor core; the datasheet's 1,979 TFLOPS is with sparsity

BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]
PROBE_BATCH = 128  # a memory-bound batch the chapter asks about


def step_times(batch: int) -> tuple[float, float]:
    """Seconds to read the weights once, and seconds for the batch's FLOPs."""
    memory = PARAMS * BYTES_PER_PARAM / HBM_BYTES_PER_S
    compute = 2 * PARAMS * batch / PEAK_FLOP_PER_S
    return memory, compute


def tokens_per_s(batch: int) -> float:
    """One token per request per step; the step lasts as long as its slower bound."""
    return batch / max(step_times(batch))


def flop_per_weight_byte() -> float:
    """FLOPs one request's token does for each weight byte the step reads."""
    return 2 * PARAMS / (PARAMS * BYTES_PER_PARAM)


def ridge_batch() -> float:
    """The batch at which both bounds take equally long: FLOP/s over bytes/s, per FLOP/byte."""
    return PEAK_FLOP_PER_S / HBM_BYTES_PER_S / flop_per_weight_byte()


def main() -> dict:
    ridge = PEAK_FLOP_PER_S / HBM_BYTES_PER_S
    weights = PARAMS * BYTES_PER_PARAM
    ceiling = PEAK_FLOP_PER_S / (2 * PARAMS)
    print(f"{GPU}, published figures (not measured):")
    print(
        f"  {HBM_BYTES_PER_S / 1e12:.1f} TB/s HBM, {PEAK_FLOP_PER_S / 1e12:.0f} TFLOP/s dense "
        f"{DTYPE.upper()}"
    )
    print(f"{MODEL}-like: {PARAMS / 1e9:.1f}B parameters in {DTYPE},")
    print(f"  {weights / 1e9:.0f} GB of weights read per step")
    print(f"  incl. the embedding table: {EMBEDDING_PARAMS / PARAMS:.1%},")
    print("  counted as if it were multiplied")
    print()
    print(f"{'batch':>5} {'memory':>7} {'compute':>7} {'tokens/s':>8} {'each':>6}  bound")
    print(f"{'':>5} {'ms':>7} {'ms':>7}")
    rows = {}
    for batch in BATCHES:
        memory, compute = step_times(batch)
        rate = tokens_per_s(batch)
        bound = "memory" if memory >= compute else "compute"
        rows[batch] = rate
        print(
            f"{batch:>5} {memory * 1e3:>7.3f} {compute * 1e3:>7.3f}"
            f" {rate:>8,.0f} {rate / batch:>6.1f}  {bound}"
        )
    print()
    last_memory_bound = int(ridge_batch())
    print(f"ridge point of the {GPU}: {ridge:.0f} FLOP per byte read")
    print(f"a decode step does {flop_per_weight_byte():.0f} FLOP per weight byte")
    print("  for each request in the batch")
    print(f"memory-bound up to batch {last_memory_bound},")
    print(f"  compute-bound from batch {last_memory_bound + 1}")
    print(f"ceiling: {ceiling:,.0f} tokens/s, whatever the batch")
    return {
        "model": MODEL,
        "gpu": GPU,
        "params_billion": PARAMS / 1e9,
        "weight_gb": weights / 1e9,
        "embedding_params_billion": EMBEDDING_PARAMS / 1e9,
        "embedding_share": EMBEDDING_PARAMS / PARAMS,
        "hbm_tb_per_s": HBM_BYTES_PER_S / 1e12,
        "peak_tflop_per_s": PEAK_FLOP_PER_S / 1e12,
        "memory_ms": step_times(1)[0] * 1e3,
        "tokens_per_s_batch_1": rows[1],
        "probe_batch": PROBE_BATCH,
        "per_request_at_probe_batch": rows[PROBE_BATCH] / PROBE_BATCH,
        "largest_batch": BATCHES[-1],
        "per_request_largest_batch": rows[BATCHES[-1]] / BATCHES[-1],
        "ridge_flop_per_byte": ridge,
        "flop_per_weight_byte": flop_per_weight_byte(),
        "last_memory_bound_batch": last_memory_bound,
        "first_compute_bound_batch": last_memory_bound + 1,
        "ceiling_tokens_per_s": ceiling,
    }


if __name__ == "__main__":
    main()
