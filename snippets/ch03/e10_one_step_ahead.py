"""Experiment 10: one-step-ahead scheduling. What does overlapping buy?

The same steps as Experiment 9, with the same costs and the same seed, run
the way an engine with async scheduling runs them. The CPU schedules step N and
builds its inputs, launches it, and only then waits for step N-1 and processes
its outputs. The GPU starts step N as soon as it has finished step N-1 and step
N has been launched. While the GPU runs one step, the CPU prepares the next.

The experiment reports the GPU's idle share and the throughput of both loops,
and their ratio.
"""

from __future__ import annotations

import random

SEED = 9
STEPS = 200
JITTER = 0.1
HBM_BYTES_PER_S = 4.8e12
PEAK_FLOP_PER_S = 989e12
BYTES_PER_PARAM = 2
MODELS = {"Qwen3-0.6B": 0.6e9, "Llama-3.1-8B": 8.0e9}
CPU_STAGES = {"schedule": (50, 4), "prepare": (100, 8), "process": (50, 8)}
BATCHES = [1, 8, 32, 64, 128, 256]
SAME_AS = 9  # the experiment whose steps and costs these are


# The cost model of Experiment 9, unchanged.
def gpu_ms(params: float, batch: int) -> float:
    memory = params * BYTES_PER_PARAM / HBM_BYTES_PER_S
    compute = 2 * params * batch / PEAK_FLOP_PER_S
    return max(memory, compute) * 1e3


def cpu_ms(stage: str, batch: int) -> float:
    fixed, per_request = CPU_STAGES[stage]
    return (fixed + per_request * batch) / 1e3


def step_costs(params: float, batch: int, seed: int = SEED) -> list[dict[str, float]]:
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
    wall = sum(sum(step.values()) for step in costs)
    return wall, sum(step["forward"] for step in costs)


def one_step_ahead(costs: list[dict[str, float]]) -> tuple[float, float]:
    """(wall ms, GPU busy ms) when step N is launched before step N-1 is processed."""
    cpu = gpu = 0.0  # when the CPU, and the GPU, are next free
    done = []  # when each step's forward ends
    for n, step in enumerate(costs):
        cpu += step["schedule"] + step["prepare"]  # step N, launched
        gpu = max(gpu, cpu) + step["forward"]
        done.append(gpu)
        if n > 0:  # then wait for step N-1's tokens, and process them
            cpu = max(cpu, done[n - 1]) + costs[n - 1]["process"]
    wall = max(cpu, done[-1]) + costs[-1]["process"]
    return wall, sum(step["forward"] for step in costs)


def main() -> dict:
    print(f"Experiment {SAME_AS}'s steps and costs, seed {SEED}")
    results: dict = {"largest_batch": BATCHES[-1]}
    for name, params in MODELS.items():
        key = name.split("-")[0].lower()
        print()
        print(f"{name}: GPU idle and tokens/s")
        print(f"{'':>5} {'GPU idle':^15} {'tokens/s':^17}".rstrip())
        print(f"{'batch':>5} {'serial':>7} {'ahead':>7} {'serial':>8} {'ahead':>8} {'ratio':>6}")
        for batch in BATCHES:
            costs = step_costs(params, batch)
            (wall_s, busy), (wall_a, _) = serial(costs), one_step_ahead(costs)
            idle_s, idle_a = 1 - busy / wall_s, 1 - busy / wall_a
            rate_s, rate_a = batch * STEPS / wall_s * 1e3, batch * STEPS / wall_a * 1e3
            print(
                f"{batch:>5} {idle_s:>7.1%} {idle_a:>7.1%}"
                f" {rate_s:>8,.0f} {rate_a:>8,.0f} {rate_a / rate_s:>5.2f}x"
            )
            results[f"{key}_idle_serial_{batch}"] = idle_s
            results[f"{key}_idle_ahead_{batch}"] = idle_a
            results[f"{key}_speedup_{batch}"] = rate_a / rate_s
        best = max(BATCHES, key=lambda b: results[f"{key}_speedup_{b}"])
        results[f"{key}_best_batch"] = best
        print(f"most gained at batch {best}")
    return results


if __name__ == "__main__":
    main()
