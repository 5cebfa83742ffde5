"""`python -m engine.tools.pd_bench`: prefill/decode disaggregation measured on
this machine (Chapter 8), three ways, in one run.

1. Interference (DistServe's experiment, on a CPU): a mixed workload, short
   prompts that decode for a while with long prompts arriving among them,
   through two colocated `both` workers behind the plain router, and through
   one prefill and one decode worker behind the PD router. Time to first token
   and inter-token latency, p50 and p99, as clients measure them (the time
   between two streamed events, per token they carry).
2. Store throughput: MB/s to put and get one block's entry, for the directory
   store and, when redis-server is installed, for Redis.
3. Break-even: for prompt lengths, an engine's time to its first token when
   it computes the prompt, and when it loads the prompt's blocks from the
   directory store (kv_store_load="always"); the shortest prompt that loads faster.

Figures vary with the machine and with anything else it runs: measure idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.tools.launch import launched

MODEL = "snippets/models/deepinfer-tiny"
NAME = "deepinfer-tiny"
WORKER = ("--dtype", "float32", "--num-kv-blocks", "2048", "--no-compile-decode")
# The interference workload: SHORT prompts of SHORT_LEN tokens that decode SHORT_OUT
# tokens each, and LONG prompts of LONG_LEN tokens, one every LONG_EVERY_S seconds.
SHORT = 24
SHORT_LEN = 16
SHORT_OUT = 64
LONG = 6
LONG_LEN = 900  # deepinfer-tiny: 1,024 tokens at most
LONG_EVERY_S = 0.25


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def one(client: httpx.AsyncClient, url: str, prompt: list[int], out: int, lat: dict) -> None:
    body = {"model": NAME, "prompt": prompt, "max_tokens": out, "stream": True}
    body |= {"temperature": 0, "ignore_eos": True}
    start = last = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/completions", json=body) as reply:
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            if first is None:
                first = now
                lat["ttft"].append((now - start) * 1e3)
            elif json.loads(line[6:])["choices"]:
                lat["itl"].append((now - last) * 1e3)
            last = now


async def workload(url: str, seed: int, num_short: int, num_long: int, long_len: int) -> dict:
    """Short prompts decoding SHORT_OUT tokens, and long prompts arriving every LONG_EVERY_S."""
    rng = random.Random(seed)
    lat: dict = {"ttft": [], "itl": []}
    async with httpx.AsyncClient(timeout=None) as client:
        shorts = [
            one(client, url, [rng.randrange(3, 500) for _ in range(SHORT_LEN)], SHORT_OUT, lat)
            for _ in range(num_short)
        ]
        tasks = [asyncio.ensure_future(t) for t in shorts]
        long_lat: dict = {"ttft": [], "itl": []}
        for _ in range(num_long):
            await asyncio.sleep(LONG_EVERY_S)
            prompt = [rng.randrange(3, 500) for _ in range(long_len)]
            tasks.append(asyncio.ensure_future(one(client, url, prompt, 4, long_lat)))
        await asyncio.gather(*tasks)
    return {"short": lat, "long": long_lat}


ROWS = [
    ("short TTFT", "short", "ttft"),
    ("short ITL", "short", "itl"),
    ("long TTFT", "long", "ttft"),
]
QUANTILES = (0.5, 0.99)


def measure_interference(args: argparse.Namespace) -> dict:
    """Two colocated workers against one prefill and one decode worker: each
    arrangement's latencies (ms, per group and kind) and the split's accounting."""
    shape = (args.short, args.long, args.long_len)
    with tempfile.TemporaryDirectory() as store:
        pd = ("--kv-store", store)
        rr = ("--policy", "round-robin")
        with (
            launched("serve", MODEL, *WORKER) as a,
            launched("serve", MODEL, *WORKER) as b,
            launched("router", "--worker", a, "--worker", b, *rr) as r,
        ):
            colocated = asyncio.run(workload(r, args.seed, *shape))
        with (
            launched("serve", MODEL, *WORKER, *pd, "--role", "prefill") as p,
            launched("serve", MODEL, *WORKER, *pd, "--role", "decode") as d,
            launched("router", "--prefill", p, "--decode", d, "--model", MODEL) as r,
        ):
            split = asyncio.run(workload(r, args.seed, *shape))
            accounting = transfer_accounting(scrape(p), scrape(d))
    return {"colocated": colocated, "split": split, "accounting": accounting}


def percentiles(measured: dict) -> dict[str, dict[str, list[float]]]:
    """Each row's p50 and p99, colocated and split: {row: {arrangement: [p50, p99]}}."""
    return {
        label: {
            side: [round(percentile(measured[side][group][kind], q), 1) for q in QUANTILES]
            for side in ("colocated", "split")
        }
        for label, group, kind in ROWS
    }


def machine() -> str:
    """The CPU this ran on, as /proc/cpuinfo names it, and how many cores it may use."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        names = [ln for ln in lines if ln.startswith("model name")]
        name = names[0].split(":", 1)[1].strip()
    except (OSError, IndexError):
        lines, name = [], platform.machine() or "unknown CPU"
    flags = " ".join(ln for ln in lines if ln.startswith("flags")) if name else ""
    isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else ""
    return f"{name}{f' ({isa})' if isa else ''}, {len(os.sched_getaffinity(0))} cores"


def interference(args: argparse.Namespace) -> None:
    measured = measure_interference(args)
    table = percentiles(measured)
    print(f"{'ms':<26}{'p50':>9}{'p99':>9}{'p50':>9}{'p99':>9}")
    print(f"{'':<26}{'colocated':>18}{'prefill/decode':>18}")
    for label, cells in table.items():
        shown = cells["colocated"] + cells["split"]
        print(f"{label:<26}" + "".join(f"{c:9.1f}" for c in shown))
    print(measured["accounting"])
    if args.save:  # one run, kept for a plot (snippets/plots/pd_bench.py)
        workload = {"short": args.short, "long": args.long, "long_len": args.long_len}
        record = {"machine": machine(), "workload": workload, "ms": table}
        record["accounting"] = measured["accounting"].splitlines()
        Path(args.save).write_text(json.dumps(record, indent=1) + "\n")


def scrape(url: str) -> dict[str, float]:
    """A worker's /metrics, each sample by name and its direction label (if any)."""
    samples = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in family.samples:
            direction = s.labels.get("direction")
            samples[s.name + (f":{direction}" if direction else "")] = s.value
    return samples


def transfer_accounting(prefill: dict[str, float], decode: dict[str, float]) -> str:
    """Per request, from the split run's workers: bytes saved and loaded, and the
    decode side's transfer time against its estimated time to compute; the store's
    hits, misses and corrupt entries as the decode worker read them."""
    k = "deepinfer:kv_store_"
    saves, loads = prefill[k + "request_bytes_count:save"], decode[k + "request_bytes_count:load"]
    saved = prefill[k + "request_bytes_sum:save"] / max(saves, 1)
    loaded = decode[k + "request_bytes_sum:load"] / max(loads, 1)
    ratio = decode[k + "load_seconds_total"] / max(
        decode[k + "recompute_seconds_estimate_total"], 1e-9
    )
    reads = ", ".join(
        f"{n} {decode[f'{k}backend_{n}_total']:.0f}" for n in ("hits", "misses", "corrupt")
    )
    return "\n".join(
        [
            f"saved per request: {saved:,.0f} B ({saves:.0f} requests)",
            f"loaded per request: {loaded:,.0f} B ({loads:.0f} requests)",
            f"load seconds / estimated recompute seconds: {ratio:.2f}",
            f"decode worker's store reads: {reads}",
        ]
    )


def store_throughput(args: argparse.Namespace) -> None:
    from engine.tools import store_bench

    store_bench.main([])


def break_even(args: argparse.Namespace) -> None:
    """Time to the first token, computing the prompt or loading it from the store."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0)
    kw = dict(model=MODEL, dtype="float32", num_kv_blocks=512, enable_prefix_caching=True)
    rng = random.Random(args.seed)
    print(f"{'prompt tokens':>14}{'compute ms':>12}{'load ms':>10}{'load/compute':>14}")
    with tempfile.TemporaryDirectory() as store:
        saver = LLM(**kw, kv_store=store)
        for length in (16, 64, 256, 900):
            times = {"compute": [], "load": []}
            for _ in range(args.repeats):
                prompt = [rng.randrange(3, 500) for _ in range(length + 1)]
                saver.generate([prompt], params, use_tqdm=False)  # saves its blocks
                for side, extra in (("compute", {}), ("load", {"kv_store": store})):
                    llm = LLM(**kw, **extra, kv_store_load="always")
                    start = time.perf_counter()
                    llm.generate([prompt], params, use_tqdm=False)
                    times[side].append((time.perf_counter() - start) * 1e3)
                    llm.shutdown()
            c, ld = (statistics.median(times[s]) for s in ("compute", "load"))
            print(f"{length:>14}{c:>12.2f}{ld:>10.2f}{ld / c:>14.2f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["interference", "store", "break-even", "all"])
    parser.add_argument("--short", type=int, default=SHORT, help="short requests")
    parser.add_argument("--long", type=int, default=LONG, help="long prompts arriving")
    parser.add_argument("--long-len", type=int, default=LONG_LEN)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--save", help="write the interference run's percentiles to this JSON")
    args = parser.parse_args(argv)
    parts = {"interference": interference, "store": store_throughput, "break-even": break_even}
    for name, part in parts.items():
        if args.part in (name, "all", None):
            print(f"== {name}")
            part(args)


if __name__ == "__main__":
    main()
