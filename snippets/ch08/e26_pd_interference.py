"""Experiment 26: prefill/decode interference, against disaggregation.

Two GPUs serve one seeded Poisson stream of requests, in three arrangements:

- colocated: requests alternate between the GPUs, and each GPU runs the
  engine's scheduler with its default budget of 8,192 tokens a step. A prompt
  is prefilled whole in the step that admits it, beside the running decodes,
  which all wait for it.
- chunked: the same, with a budget of CHUNK_BUDGET tokens a step. Decodes take
  one token each first, and prompts get what is left, in arrival order, so a
  long prompt is spread over many steps and every step stays short.
- disaggregated: one GPU prefills every prompt and emits its first token;
  the prompt's KV cache then crosses a link to the other GPU, which only
  decodes. Transfers queue on the link, one at a time, at LINK_BYTES_PER_S.

A step's time is a stated cost model, not a measurement. Every step reads the
weights once (Experiment 2's memory bound: 16 GB over the published 4.8 TB/s
of an H200 SXM). Each prompt token adds its 2 * PARAMS FLOPs at PREFILL_MFU of
the published dense BF16 peak. Each decoding sequence adds the read of its
cached keys and values, KV_BYTES_PER_TOKEN for every token of its context; its
own multiply-adds hide under the weight read, as a memory-bound step's do.
The model is Llama-3.1-8B (32 layers, 8 KV heads of 128 channels, bf16).

TTFT is a request's arrival to its first token; ITL is the gap between two
consecutive tokens of one request. A request meets the SLO when its TTFT is
at most TTFT_SLO_S and none of its gaps is longer than ITL_SLO_S.
"""

from __future__ import annotations

import math
import random
from collections import deque

SEED = 26
MODEL = "Llama-3.1-8B"
PARAMS = 8.0e9
BYTES_PER_PARAM = 2  # bf16
GPU = "H200 SXM"
HBM_BYTES_PER_S = 4.8e12  # published, as in Experiment 2
PEAK_FLOP_PER_S = 989e12  # dense BF16, published
PREFILL_MFU = 0.5  # assumed share of that peak a prefill reaches
KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # K and V, layers, KV heads, dims, bf16
LINK_BYTES_PER_S = 50e9  # one CX7 400 Gb/s RDMA card, as DeepEP's V1 docs put it
ENGINE_BUDGET = 8192  # the engine's default max_num_batched_tokens
CHUNK_BUDGET = 512  # the chunked arm's budget
GPUS = 2
REQUESTS = 1500
RATES = [7, 14, 21, 28]  # mean arrivals per second, Poisson
RATE = 14  # the rate whose distributions the first table gives
LONG_SHARE = 0.2  # the share of requests with a long prompt
SHORT_PROMPT = (64, 512)  # tokens, uniform
LONG_PROMPT = (2048, 6144)
OUTPUT_TOKENS = (32, 512)
TTFT_SLO_S = 0.5
ITL_SLO_S = 0.1
TTFT_QS = (50, 99)  # percentiles printed
ITL_QS = (50, 99, 99.9)
PLACES = 1  # milliseconds are printed to this many places
COL = 8  # the width of the last table's columns
SHORT = {"colocated": "coloc.", "chunked": "chunked", "disaggregated": "disagg."}

STEP_FIXED_S = PARAMS * BYTES_PER_PARAM / HBM_BYTES_PER_S
PREFILL_S_PER_TOKEN = 2 * PARAMS / (PEAK_FLOP_PER_S * PREFILL_MFU)
KV_READ_S_PER_TOKEN = KV_BYTES_PER_TOKEN / HBM_BYTES_PER_S


class Job:
    """One request's work on one GPU: prompt tokens to prefill, tokens already
    cached when it arrives, and tokens to emit here."""

    def __init__(self, arrival: float, prompt: int, context: int, outputs: int) -> None:
        self.arrival, self.prompt, self.context, self.outputs = arrival, prompt, context, outputs
        self.done = 0  # prompt tokens prefilled so far
        self.times: list[float] = []  # when each of its tokens came out


def workload(rng: random.Random, rate: float) -> list[tuple[float, int, int]]:
    """(arrival, prompt tokens, output tokens) for every request."""
    t, requests = 0.0, []
    for _ in range(REQUESTS):
        t += rng.expovariate(rate)
        low, high = LONG_PROMPT if rng.random() < LONG_SHARE else SHORT_PROMPT
        requests.append((t, rng.randint(low, high), rng.randint(*OUTPUT_TOKENS)))
    return requests


def step_time(prefill_tokens: int, decode_context: int) -> float:
    """Weights read once, plus prompt FLOPs, plus the decodes' KV reads."""
    return (
        STEP_FIXED_S + PREFILL_S_PER_TOKEN * prefill_tokens + KV_READ_S_PER_TOKEN * decode_context
    )


def transfer_time(prompt: int) -> float:
    """Seconds for a prompt's KV cache to cross the link."""
    return prompt * KV_BYTES_PER_TOKEN / LINK_BYTES_PER_S


def plan_step(
    running: list[Job], waiting: deque[Job], now: float, budget: int
) -> list[tuple[Job, int]]:
    """The scheduler's order: each decode one token, then prompt pieces in
    arrival order, first the running ones, then newly admitted, while the
    budget lasts. Returns (job, its tokens this step) pairs."""
    plan: list[tuple[Job, int]] = []
    for job in running:
        if job.done == job.prompt and budget > 0:
            plan.append((job, 1))
            budget -= 1
    for job in running:
        if job.done < job.prompt and budget > 0:
            plan.append((job, min(job.prompt - job.done, budget)))
            budget -= plan[-1][1]
    while waiting and waiting[0].arrival <= now and budget > 0:
        job = waiting.popleft()
        running.append(job)
        # a job whose cache arrived from elsewhere (no prompt) decodes
        plan.append((job, min(job.prompt, budget) if job.prompt else 1))
        budget -= plan[-1][1]
    return plan


def run_gpu(jobs: list[Job], budget: int) -> None:
    """Step one GPU until every job has emitted its tokens; fills job.times."""
    waiting, running, now = deque(sorted(jobs, key=lambda j: j.arrival)), [], 0.0
    while waiting or running:
        if not running and waiting[0].arrival > now:
            now = waiting[0].arrival  # idle until the next arrival
        plan = plan_step(running, waiting, now, budget)
        prefill = sum(n for job, n in plan if job.done < job.prompt)
        context = sum(job.context for job, _ in plan if job.done == job.prompt)
        now += step_time(prefill, context)
        for job, n in plan:
            if job.done < job.prompt:
                job.done += n
                job.context += n
                if job.done < job.prompt:
                    continue  # a piece of its prompt: no token yet
            else:
                job.context += 1
            job.times.append(now)
        running = [j for j in running if len(j.times) < j.outputs]


def colocated(requests: list[tuple[float, int, int]], budget: int) -> list[list[float]]:
    """Requests alternate between the GPUs; each GPU prefills and decodes."""
    jobs = [Job(t, prompt, 0, out) for t, prompt, out in requests]
    for gpu in range(GPUS):
        run_gpu(jobs[gpu::GPUS], budget)
    return [job.times for job in jobs]


def disaggregated(requests: list[tuple[float, int, int]]) -> list[list[float]]:
    """Prefill on one GPU (first token there), ship the KV, decode on the other."""
    prefills = [Job(t, prompt, 0, 1) for t, prompt, _ in requests]
    run_gpu(prefills, ENGINE_BUDGET)
    decodes = [Job(0.0, 0, prompt, out - 1) for _, prompt, out in requests]
    link_free = 0.0
    for i in sorted(range(len(requests)), key=lambda i: prefills[i].times[0]):
        start = max(prefills[i].times[0], link_free)  # the link sends one at a time
        link_free = start + transfer_time(requests[i][1])
        decodes[i].arrival = link_free  # it joins the decode GPU's next step
    run_gpu(decodes, ENGINE_BUDGET)
    return [p.times + d.times for p, d in zip(prefills, decodes)]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank q-th percentile."""
    ranked = sorted(values)
    return ranked[max(1, math.ceil(len(ranked) * q / 100)) - 1]


def latencies(requests: list[tuple[float, int, int]], times: list[list[float]]) -> dict:
    """TTFTs, every inter-token gap, and per request: a gap over the ITL SLO,
    and both SLOs met."""
    ttft = [ts[0] - t for (t, _, _), ts in zip(requests, times)]
    gaps = [[b - a for a, b in zip(ts, ts[1:])] for ts in times]
    stalled = [max(g) > ITL_SLO_S for g in gaps]
    met = [f <= TTFT_SLO_S and not s for f, s in zip(ttft, stalled)]
    itl = [x for g in gaps for x in g]
    return {
        "ttft": ttft,
        "itl": itl,
        "long_gaps": sum(x > ITL_SLO_S for x in itl) / len(itl),
        "stalled": sum(stalled) / len(stalled),
        "slo": sum(met) / len(met),
    }


def arms(requests: list[tuple[float, int, int]]) -> dict:
    """Each arrangement's token times, for the same requests."""
    return {
        "colocated": colocated(requests, ENGINE_BUDGET),
        "chunked": colocated(requests, CHUNK_BUDGET),
        "disaggregated": disaggregated(requests),
    }


def prompt_load(requests: list[tuple[float, int, int]]) -> float:
    """The share of one GPU's time that the prompts' FLOPs alone would take."""
    work = sum(prompt for _, prompt, _ in requests) * PREFILL_S_PER_TOKEN
    return work / requests[-1][0]


def print_setup() -> dict:
    """The cost model and the workload; the costs the prose quotes."""
    whole, chunk = step_time(LONG_PROMPT[1], 0), step_time(CHUNK_BUDGET, 0)
    longest = transfer_time(LONG_PROMPT[1])
    print(f"{MODEL}-like on {GPU} GPUs, modelled:")
    weights, hbm = PARAMS * BYTES_PER_PARAM / 1e9, HBM_BYTES_PER_S / 1e12
    print(f"  a step: {STEP_FIXED_S * 1e3:.2f} ms to read {weights:.0f} GB at {hbm:.1f} TB/s,")
    print(f"  + {PREFILL_S_PER_TOKEN * 1e6:.1f} us for each prompt token")
    print(f"    ({PEAK_FLOP_PER_S / 1e12:.0f} TFLOP/s at {PREFILL_MFU:.0%}),")
    print(f"  + {KV_READ_S_PER_TOKEN * 1e9:.1f} ns for each cached token a decode reads")
    print(f"  so a prompt of {LONG_PROMPT[1]} takes {whole * 1e3:.{PLACES}f} ms whole,")
    print(f"  and a step with a {CHUNK_BUDGET}-token chunk {chunk * 1e3:.{PLACES}f} ms")
    print(f"KV {KV_BYTES_PER_TOKEN // 1024} KiB a token; over {LINK_BYTES_PER_S / 1e9:.0f} GB/s,")
    print(f"  {LONG_PROMPT[1]} tokens' KV takes {longest * 1e3:.{PLACES}f} ms")
    print(f"{REQUESTS} requests, Poisson, on {GPUS} GPUs;")
    print(f"  {LONG_SHARE:.0%} with a long prompt, {LONG_PROMPT[0]}-{LONG_PROMPT[1]} tokens,")
    print(
        f"  the rest {SHORT_PROMPT[0]}-{SHORT_PROMPT[1]}; outputs {OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]}"
    )
    print(f"budgets: {ENGINE_BUDGET} tokens a step, chunked {CHUNK_BUDGET}")
    print(f"SLO: TTFT <= {TTFT_SLO_S * 1e3:.0f} ms, every gap <= {ITL_SLO_S * 1e3:.0f} ms")
    return {
        "step_fixed_ms": round(STEP_FIXED_S * 1e3, 2),
        "prefill_us_per_token": round(PREFILL_S_PER_TOKEN * 1e6, 1),
        "kv_read_ns_per_token": round(KV_READ_S_PER_TOKEN * 1e9, 1),
        "longest_prompt": LONG_PROMPT[1],
        "whole_prefill_ms": round(whole * 1e3, PLACES),
        "chunk_step_ms": round(chunk * 1e3, PLACES),
        "longest_transfer_ms": round(longest * 1e3, PLACES),
        "kv_kib_per_token": KV_BYTES_PER_TOKEN // 1024,
        "weight_gb": weights,
        "hbm_tb_per_s": hbm,
        "peak_tflop_per_s": round(PEAK_FLOP_PER_S / 1e12),
        "prefill_mfu": PREFILL_MFU,
        "link_gb_per_s": round(LINK_BYTES_PER_S / 1e9),
        "gpus": GPUS,
        "long_share": LONG_SHARE,
        "short_min": SHORT_PROMPT[0],
        "short_max": SHORT_PROMPT[1],
        "long_min": LONG_PROMPT[0],
        "output_min": OUTPUT_TOKENS[0],
        "output_max": OUTPUT_TOKENS[1],
    }


def simulate(rate: int) -> tuple[float, dict]:
    """The prompts' load at this rate, and each arm's latencies."""
    requests = workload(random.Random(SEED), rate)
    runs = {name: latencies(requests, times) for name, times in arms(requests).items()}
    return prompt_load(requests), runs


def print_distributions(stats: dict) -> dict:
    """The first table, and its values as named results."""
    print(f"{'':13} {'TTFT ms':>13} {'ITL ms':>20} {'SLO':>6}")
    heads = "".join(f" {'p' + format(q, 'g'):>6}" for q in TTFT_QS + ITL_QS)
    print(f"{'arm':13}{heads} {'met':>6}")
    names = [f"ttft_p{q:g}" for q in TTFT_QS] + [f"itl_p{q:g}" for q in ITL_QS]
    results = {}
    for arm, lat in stats.items():
        row = [percentile(lat["ttft"], q) * 1e3 for q in TTFT_QS]
        row += [percentile(lat["itl"], q) * 1e3 for q in ITL_QS]
        print(f"{arm:13}" + "".join(f" {x:>6.{PLACES}f}" for x in row) + f" {lat['slo']:>6.1%}")
        for name, x in zip(names, row):
            results[f"{arm}_{name.replace('.', '')}_ms"] = round(x, PLACES)
        for key in ("slo", "stalled", "long_gaps"):
            results[f"{arm}_{key}"] = round(lat[key], 4)
    return results


def print_stalls(stats: dict) -> None:
    print(f"gaps longer than {ITL_SLO_S * 1e3:.0f} ms:")
    print(f"{'arm':13} {'share of gaps':>14} {'of requests':>13}")
    for arm, lat in stats.items():
        print(f"{arm:13} {lat['long_gaps']:>14.2%} {lat['stalled']:>13.1%}")


def print_sweep(sweep: dict) -> dict:
    """Requests meeting the SLO at every rate, with the prompts' load."""
    arms_ = list(next(iter(sweep.values()))[1])
    print("requests meeting the SLO, by arrival rate")
    print(f"{'rate/s':>6} {'prompts':>7}" + "".join(f" {SHORT[a]:>{COL}}" for a in arms_))
    results = {}
    for rate, (load, stats) in sweep.items():
        shares = [stats[a]["slo"] for a in arms_]
        print(f"{rate:>6} {load:>7.0%}" + "".join(f" {x:>{COL}.1%}" for x in shares))
        results |= {f"{a}_slo_r{rate}": round(x, 4) for a, x in zip(arms_, shares)}
        results[f"load_r{rate}"] = round(load, 3)
    return results


def main() -> dict:
    results: dict = print_setup()
    sweep = {rate: simulate(rate) for rate in RATES}
    load, stats = sweep[RATE]
    print()
    print(f"at {RATE} requests/s (prompts alone: {load:.0%} of a GPU)")
    results |= {"rate": RATE, "rates": RATES, "requests": REQUESTS, "load": round(load, 3)}
    results |= print_distributions(stats)
    print()
    print_stalls(stats)
    print()
    results |= print_sweep(sweep)
    results |= {"ttft_slo_ms": round(TTFT_SLO_S * 1e3), "itl_slo_ms": round(ITL_SLO_S * 1e3)}
    results |= {"chunk_budget": CHUNK_BUDGET, "engine_budget": ENGINE_BUDGET}
    return results


if __name__ == "__main__":
    main()
