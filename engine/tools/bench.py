"""`deepinfer bench`: throughput and latency of the engine on random prompts,
optionally against transformers' padded batched generate on the same model and
workload; and the bytes the KV cache keeps per token, as the engine's cache pool
counts them, against a dense attention of the same width (which is what MLA saves).

What keeps the comparison honest: each side runs in a process of its own (so
its peak RSS is its own); each warms up on prompts unrelated to the timed ones
(so no timed prompt hits the prefix cache) and is timed over several repeats,
each on fresh prompts of the same lengths, reported as the best and the median;
transformers' padding is stated; and the decode step is timed on fresh prompts,
beside the floor that the CPU's measured matmul rate and bandwidth allow."""

from __future__ import annotations

import multiprocessing
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from engine.config import EngineConfig
from engine.core.trace import STAGES, StepTrace
from engine.kv.kv_cache import FullAttentionSpec
from engine.layers.linear import PackedLinear, SharedWeightLinear
from engine.llm import LLM
from engine.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class Result:
    seconds: float
    output_tokens: int
    ttft_ms: list[float]
    itl_ms: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


@dataclass
class Workload:
    """Prompt lengths fixed once; each repeat draws fresh tokens of those lengths."""

    lengths: list[int]
    vocab: int
    seed: int

    def prompts(self, repeat: int) -> list[list[int]]:
        rng = random.Random(f"{self.seed}/{repeat}")
        return [[rng.randrange(self.vocab) for _ in range(n)] for n in self.lengths]

    def warm_up(self) -> list[list[int]]:
        """A few prompts unrelated to any timed one (their own random stream)."""
        return self.prompts(-1)[:8]


@dataclass
class Side:
    """One side's figures, from its own process."""

    runs: list[Result]
    peak_rss_mb: float
    dtype: str
    threads: int
    extra: dict = field(default_factory=dict)


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")  # not Linux


def warm_up(llm: LLM, prompts: list[list[int]]) -> None:
    llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> Result:
    """One timed generate; the caller warms up first, on other prompts."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [(o.times.first_token - o.times.arrival) * 1e3 for o in outputs]
    itl = [
        (o.times.finished - o.times.first_token) * 1e3 / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
    ]
    return Result(seconds, sum(len(o.token_ids) for o in outputs), ttft, itl)


@dataclass
class DecodeSteps:
    """Decode steps measured at one batch size: the mean step, and its host work."""

    step_s: float  # mean seconds a step
    outside: float  # share of the step outside the model's forward pass
    stages_ms: dict[str, float]  # mean ms a step in each stage of the host's work


def decode_overhead(llm: LLM, prompts: list[list[int]], steps: int = 16) -> DecodeSteps:
    """Mean decode step time and the share of it spent outside the model's
    forward pass, with every prompt in the batch already prefilled, and that
    share by stage, from a step trace (engine/core/trace.py) attached for the
    timed steps alone. The prompts must be fresh: cached ones would make the
    prefill, not the step, cheaper."""
    engine = llm.llm_engine
    # FINAL_ONLY, as LLM.generate asks (the runs above): text is spelled once, at the
    # end, not every step (a server's front end does that, beside the core).
    params = SamplingParams(
        temperature=0,
        max_tokens=steps + 2,
        ignore_eos=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
    )
    for i, p in enumerate(prompts):
        engine.add_request(f"decode-{i}", p, params)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):
        engine.step()
    stats, runner = engine.stats, engine.executor.model_runner
    trace = StepTrace(engine.scheduler, runner, engine.output_processor, stats)
    step0, fwd0 = stats.step_seconds, stats.forward_seconds
    for _ in range(steps):
        engine.step()
    step, fwd = stats.step_seconds - step0, stats.forward_seconds - fwd0
    trace.detach()
    while engine.has_unfinished_requests():
        engine.step()
    return DecodeSteps(step / steps, (step - fwd) / step, host_stages(trace, step, fwd, steps))


def host_stages(trace: StepTrace, step: float, forward: float, steps: int) -> dict[str, float]:
    """Mean ms a step in each stage outside the forward pass. Sampling is the
    traced forward stage less the model's forward pass; "other" is the rest of
    the step (the engine's own bookkeeping, the trace's timers)."""
    total = {stage: 0.0 for stage in STAGES}
    for span in trace.spans:
        if span.lane != "gpu":
            total[span.stage] += span.end - span.start
    ms = {
        "schedule": total["schedule"],
        "inputs": total["prepare"],
        "sampling": total["forward"] - forward,
        "update": total["update"],
        "outputs": total["process"],
    }
    ms["other"] = step - forward - sum(ms.values())
    return {name: seconds / steps * 1e3 for name, seconds in ms.items()}


def matmul_gflops(dtype: torch.dtype, n: int = 1024, tries: int = 5) -> float:
    """The best rate of one n x n x n matmul in ``dtype`` on this CPU."""
    a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
    torch.mm(a, b)
    best = min(_timed(lambda: torch.mm(a, b)) for _ in range(tries))
    return 2 * n**3 / best / 1e9


def bandwidth_gbs(mb: int = 256, tries: int = 3) -> float:
    """The best rate at which one large tensor is read (summed), in GB/s."""
    x = torch.ones(mb * 2**20 // 4)
    x.sum()
    return x.numel() * 4 / min(_timed(x.sum) for _ in range(tries)) / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def decode_floor_ms(llm: LLM, batch: int, mean_context: float) -> tuple[float, str]:
    """The time one decode step of ``batch`` sequences cannot beat on this CPU: every
    linear layer's FLOP at the measured matmul rate (or its weights' bytes at the
    measured bandwidth, if that is longer), plus the KV cache's bytes read."""
    runner = llm.llm_engine.executor.model_runner
    kinds = (nn.Linear, PackedLinear, SharedWeightLinear)
    linear = [m.weight for m in runner.model.modules() if isinstance(m, kinds)]
    params = sum(w.numel() for w in linear)
    dtype = llm.llm_engine.config.dtype
    gflops, gbs = matmul_gflops(dtype), bandwidth_gbs()
    flop_ms = 2 * params * batch / gflops / 1e6
    weight_ms = params * dtype.itemsize / gbs / 1e6
    pool = runner.kv_cache
    kv_ms = batch * mean_context * pool.block_bytes() / pool.block_size / gbs / 1e6
    why = (
        f"matmul {flop_ms:.2f} ms at {gflops:.0f} GFLOP/s "
        f"(weights {weight_ms:.2f} ms at {gbs:.1f} GB/s) + KV {kv_ms:.2f} ms"
    )
    return max(flop_ms, weight_ms) + kv_ms, why


def engine_side(
    model: str,
    work: Workload,
    output_len: int,
    repeats: int,
    llm_kwargs: dict,
    kv_baselines: list[str],
) -> Side:
    """The engine's figures, in a process of its own."""
    llm = LLM(model, **llm_kwargs)
    warm_up(llm, work.warm_up())
    runs = [run_engine(llm, work.prompts(r), output_len) for r in range(repeats)]
    decode_prompts = work.prompts(repeats)  # fresh: not in the prefix cache
    decode = decode_overhead(llm, decode_prompts)
    mean_ctx = statistics.mean(work.lengths) + 1 + 8  # mid-way through the 16 timed steps
    floor_ms, why = decode_floor_ms(llm, len(work.lengths), mean_ctx)
    extra = dict(
        step_ms=decode.step_s * 1e3,
        outside=decode.outside,
        stages_ms=decode.stages_ms,
        floor_ms=floor_ms,
        floor_why=why,
    )
    compiled = llm.llm_engine.executor.model_runner.compiled
    extra["compile_s"] = compiled.compile_seconds if compiled else None
    cfg = llm.llm_engine.config
    extra["compile_mode"] = cfg.compile_mode
    extra["kv_lines"] = kv_cache_lines(llm, kv_baselines)
    return Side(runs, peak_rss_mb(), _name(cfg.dtype), torch.get_num_threads(), extra)


class _FirstToken:
    """A transformers streamer that notes when the first generated token arrives
    (its first put() is the prompt, its second the first token)."""

    def __init__(self) -> None:
        self.puts: list[float] = []

    def put(self, value) -> None:
        self.puts.append(time.perf_counter())

    def end(self) -> None:
        pass


def padded_batch(prompts: list[list[int]], device: str, pad: int = 0):
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def run_transformers(
    path: str,
    prompts: list[list[int]],
    output_len: int,
    device: str,
    dtype: torch.dtype,
    model=None,
) -> Result:
    """One left-padded batch through transformers' generate, greedy, fixed length."""
    if model is None:
        model = load_transformers(path, device, dtype)
    ids, mask = padded_batch(prompts, device)
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=0
    )
    first = _FirstToken()
    with torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, streamer=first, **kwargs)
        seconds = time.perf_counter() - start
    ttft = (first.puts[1] - start) * 1e3 if len(first.puts) > 1 else seconds * 1e3
    itl = (seconds * 1e3 - ttft) / max(output_len - 1, 1)
    return Result(seconds, (out.shape[1] - ids.shape[1]) * len(prompts), [ttft], [itl])


def load_transformers(path: str, device: str, dtype: torch.dtype):
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise SystemExit("--compare-hf needs transformers (make test installs it)") from err
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def transformers_side(
    model: str, work: Workload, output_len: int, repeats: int, device: str, dtype: torch.dtype
) -> Side:
    """transformers' figures, in a process of its own, warmed up and repeated alike."""
    hf = load_transformers(model, device, dtype)
    run_transformers(model, work.warm_up(), 4, device, dtype, hf)
    runs = [
        run_transformers(model, work.prompts(r), output_len, device, dtype, hf)
        for r in range(repeats)
    ]
    return Side(runs, peak_rss_mb(), _name(dtype), torch.get_num_threads())


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def in_own_process(fn, *args) -> Side:
    """Run ``fn`` in a fresh interpreter, so that what it allocates is its own."""
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        return pool.submit(fn, *args).result()


def kv_bytes_per_token_per_layer(llm: LLM) -> float:
    """What the engine's cache pool allocates per token, averaged over the model's
    layers; for DeepSeek-V4, in the long-context limit, where a request holds one
    block per row span (kv/compressed_cache.py) beside a window that does not grow."""
    pool, cfg = llm.llm_engine.executor.model_runner.kv_cache, llm.llm_engine.config
    spans = cfg.kv_cache_groups.spans
    tokens = spans[0].span if spans else pool.block_size
    return pool.block_bytes() / tokens / cfg.hf_config.num_hidden_layers


def kv_cache_lines(llm: LLM, baselines: list[str]) -> list[str]:
    """Bytes per token and layer: this model's, a dense multi-head attention of the
    same width (every head's key and value, head_dim = hidden / heads), and the
    dense models named in ``baselines``, each loaded into a cache pool of its own."""
    cfg = llm.llm_engine.config
    hf = cfg.hf_config
    ours = kv_bytes_per_token_per_layer(llm)
    rows = [(f"this model ({hf.architecture})", ours)]
    if cfg.kv_cache_groups.spans:
        rows[0] = ("this model (V4, long-context limit)", ours)
    if hf.mla is not None:
        rows[0] = (f"this model (MLA: {hf.mla.kv_lora_rank} + {hf.mla.qk_rope_head_dim})", ours)
        heads = hf.num_attention_heads
        mha = FullAttentionSpec(heads, hf.hidden_size // heads, cfg.dtype)
        rows.append((f"dense MHA, width {hf.hidden_size}", mha.block_bytes(1)))
    for path in baselines:
        other = LLM(path, device=cfg.device, dtype=cfg.dtype, num_kv_blocks=1)
        name = other.llm_engine.config.hf_config.architecture
        rows.append((f"{Path(path).name} ({name})", kv_bytes_per_token_per_layer(other)))
    lines = [f"KV cache per token and layer, {_name(cfg.dtype)}:"]
    for name, value in rows:
        ratio = "" if value == ours else f"  {value / ours:5.2f}x this model's"
        lines.append(f"  {name:34}{value:8.0f} bytes{ratio}")
    return lines


def _best_median(values: list[float], fmt: str) -> str:
    """The smallest value and the median one (the upper middle of an even count, so
    that it is one repeat's figure, as the best is, and of two repeats the other)."""
    return f"{format(min(values), fmt):>10}{format(statistics.median_high(values), fmt):>10}"


def median_run(runs: list[Result]) -> Result:
    return sorted(runs, key=lambda r: r.seconds)[len(runs) // 2]


def table(side: Side | None) -> dict[str, str]:
    """One side's cells: the best and the median of the repeats."""
    if side is None:
        return {}
    best, median = min(side.runs, key=lambda r: r.seconds), median_run(side.runs)
    ttft = [statistics.mean(r.ttft_ms) for r in side.runs]
    itl = [statistics.mean(r.itl_ms) for r in side.runs if r.itl_ms] or [float("nan")]
    return {
        "output tokens/s": f"{best.tokens_per_s:10.1f}{median.tokens_per_s:10.1f}",
        "total seconds": f"{best.seconds:10.2f}{median.seconds:10.2f}",
        "TTFT mean (ms)": _best_median(ttft, ".1f"),
        "inter-token mean (ms)": _best_median(itl, ".1f"),
        "peak RSS (MB)": f"{side.peak_rss_mb:10.0f}{'':>10}",
    }


def padding_line(lengths: list[int]) -> str:
    width, total = max(lengths), sum(lengths)
    pad = width * len(lengths) - total
    return (
        f"transformers left-pads every prompt to {width} tokens: {pad} of its "
        f"{width * len(lengths)} prefill positions ({pad / (width * len(lengths)):.1%}) are padding"
    )


def run(
    model: str,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    compare_hf: bool,
    seed: int = 0,
    kv_baselines: list[str] | None = None,
    repeats: int = 3,
    **llm_kwargs,
) -> str:
    rng = random.Random(seed)
    config = EngineConfig(model=model, **llm_kwargs)  # what the engine's process will use
    hf = config.hf_config
    work = Workload([rng.randint(*input_len) for _ in range(num_prompts)], hf.vocab_size, seed)
    kwargs = dict(llm_kwargs, seed=seed)
    load = os.getloadavg()[0]
    ours = in_own_process(engine_side, model, work, output_len, repeats, kwargs, kv_baselines or [])
    theirs = None
    if compare_hf:
        theirs = in_own_process(
            transformers_side, model, work, output_len, repeats, config.device, config.dtype
        )
    e = ours.extra
    lines = [
        f"model: {hf.architecture}, {hf.num_hidden_layers} layers, hidden {hf.hidden_size}, "
        f"vocab {hf.vocab_size}; {config.device}, {ours.dtype}, {ours.threads} threads; "
        f"load average {load:.2f} at the start",
        f"{num_prompts} prompts of {input_len[0]}-{input_len[1]} tokens "
        f"(mean {statistics.mean(work.lengths):.0f}), {output_len} output tokens each; "
        f"{repeats} repeats on fresh prompts after a warm-up on others, each side in its "
        "own process",
    ]
    if theirs:
        lines.append(padding_line(work.lengths))
    lines += [
        "",
        f"{'':24}{'engine':>10}{'(median)':>10}"
        + (f"{'transformers':>14}{'(median)':>10}" if theirs else ""),
    ]
    mine, other = table(ours), table(theirs)
    for name, cells in mine.items():
        lines.append(f"{name:24}{cells}" + (f"    {other[name]}" if theirs else ""))
    lines.append("(first column: the best repeat; peak RSS: the whole process, one figure)")
    lines.append("")
    lines.append(
        f"decode step at batch {num_prompts}: {e['step_ms']:.2f} ms on fresh prompts, "
        f"{e['outside']:.1%} of it ({e['step_ms'] * e['outside']:.3f} ms) outside the model "
        "forward: the host's scheduling, input building, sampling and output processing"
    )
    lines.append(
        "  of which, ms a step: "
        + ", ".join(f"{name} {ms:.3f}" for name, ms in e["stages_ms"].items())
    )
    lines.append(
        f"decode step floor: {e['floor_ms']:.2f} ms ({e['floor_why']}); "
        f"measured / floor: {e['step_ms'] / e['floor_ms']:.1f}x"
    )
    if theirs:
        best = max(r.tokens_per_s for r in ours.runs) / max(r.tokens_per_s for r in theirs.runs)
        med = median_run(ours.runs).tokens_per_s / median_run(theirs.runs).tokens_per_s
        lines.append(
            f"engine / transformers output tokens/s: {best:.2f}x best to best, "
            f"{med:.2f}x median to median; peak RSS {ours.peak_rss_mb / theirs.peak_rss_mb:.2f}x"
        )
    if e["compile_s"] is not None:
        lines.append(
            f"decode steps ran compiled (torch.compile, mode {e['compile_mode']}), compiled at "
            f"start-up in {e['compile_s']:.1f} s, which no figure above includes"
        )
    lines += ["", *e["kv_lines"]]
    return "\n".join(lines)
