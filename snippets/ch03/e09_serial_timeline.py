"""Experiment 9: a serial step timeline. How long does the GPU wait for the CPU?

An engine that does one thing at a time runs every decode step in the same
order: the CPU schedules the batch and builds its inputs, the GPU runs the
forward pass, and the CPU turns the sampled tokens into outputs. While the CPU
works, the GPU waits, and the CPU's work grows with the number of requests.

The GPU's step is Experiment 2's roofline on an H200 SXM: the longer of reading
the weights once and doing two FLOPs per parameter for every request. Each CPU
stage costs a fixed part per step plus a part per request. Those costs are
assumed, not measured: they are of the order that vLLM's developers profiled
before v0.6.0 for Llama 3 8B on one H100, where 29% of the execution time went
to scheduling in a wide sense: gathering the last step's results, choosing the
next step's requests and preparing their inputs (the vLLM blog, 5 September
2024). Every cost is jittered by up to JITTER of itself, from a seeded
generator, so that the timeline is a timeline and not one step repeated.
"""

from __future__ import annotations

import random

SEED = 9
STEPS = 200  # decode steps simulated for each model and batch
JITTER = 0.1
GPU = "H200 SXM"
HBM_BYTES_PER_S = 4.8e12  # published, as in Experiment 2
PEAK_FLOP_PER_S = 989e12  # dense BF16
BYTES_PER_PARAM = 2  # bf16 weights
MODELS = {"Qwen3-0.6B": 0.6e9, "Llama-3.1-8B": 8.0e9}  # parameters
# Each CPU stage: (microseconds per step, microseconds per request in the batch).
CPU_STAGES = {"schedule": (50, 4), "prepare": (100, 8), "process": (50, 8)}
BATCHES = [1, 8, 32, 64, 128, 256]


def gpu_ms(params: float, batch: int) -> float:
    """One decode step on the GPU: weights read once, or the batch's FLOPs."""
    memory = params * BYTES_PER_PARAM / HBM_BYTES_PER_S
    compute = 2 * params * batch / PEAK_FLOP_PER_S
    return max(memory, compute) * 1e3


def cpu_ms(stage: str, batch: int) -> float:
    fixed, per_request = CPU_STAGES[stage]
    return (fixed + per_request * batch) / 1e3


def step_costs(params: float, batch: int, seed: int = SEED) -> list[dict[str, float]]:
    """Every step's stage times in ms, each jittered: the CPU stages and "forward"."""
    rng = random.Random(f"{seed}-{params}-{batch}")

    def jitter(ms: float) -> float:
        return ms * rng.uniform(1 - JITTER, 1 + JITTER)

    return [
        {
            **{s: jitter(cpu_ms(s, batch)) for s in CPU_STAGES},
            "forward": jitter(gpu_ms(params, batch)),
        }
        for _ in range(STEPS)
    ]


def serial(costs: list[dict[str, float]]) -> tuple[float, float]:
    """(wall ms, GPU busy ms) when the stages of each step run one after another."""
    wall = sum(sum(step.values()) for step in costs)
    return wall, sum(step["forward"] for step in costs)


def main() -> dict:
    per_step = sum(f for f, _ in CPU_STAGES.values())
    per_request = sum(r for _, r in CPU_STAGES.values())
    print(f"GPU: {GPU} roofline; CPU: {per_step} us a step")
    print(f"  + {per_request} us a request; {STEPS} decode steps, seed {SEED}")
    results: dict = {"steps": STEPS, "cpu_us_per_step": per_step}
    results["cpu_us_per_request"] = per_request
    results["largest_batch"] = BATCHES[-1]
    results["batch_sizes"] = BATCHES
    for name, params in MODELS.items():
        key = name.split("-")[0].lower()
        print()
        print(name)
        print(f"{'batch':>5} {'CPU ms':>7} {'GPU ms':>7} {'GPU idle':>9} {'tokens/s':>9}")
        cpu_bound = None
        for batch in BATCHES:
            costs = step_costs(params, batch)
            wall, busy = serial(costs)
            cpu = (wall - busy) / STEPS
            gpu = busy / STEPS
            idle = 1 - busy / wall
            rate = batch * STEPS / wall * 1e3
            print(f"{batch:>5} {cpu:>7.3f} {gpu:>7.3f} {idle:>9.1%} {rate:>9,.0f}")
            results[f"{key}_idle_{batch}"] = idle
            results[f"{key}_cpu_ms_{batch}"] = cpu
            results[f"{key}_gpu_ms_{batch}"] = gpu
            if cpu_bound is None and cpu > gpu:
                cpu_bound = batch
        results[f"{key}_cpu_bound_from"] = cpu_bound
        where = f"from batch {cpu_bound}" if cpu_bound else "at no batch here"
        print(f"the CPU takes longer than the GPU {where}")
    return results


if __name__ == "__main__":
    main()
