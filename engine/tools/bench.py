"""`deepinfer bench`: throughput and latency of the engine on random prompts,
optionally against transformers' padded batched generate on the same model,
measured in the same run so that the ratio means something; and the bytes the
KV cache keeps per token, as the engine's cache pool counts them, against a
dense attention of the same width (which is what MLA saves)."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.kv_cache import FullAttentionSpec
from engine.llm import LLM
from engine.sampling_params import SamplingParams


@dataclass
class Result:
    seconds: float
    output_tokens: int
    ttft_ms: list[float]
    itl_ms: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds


def random_prompts(n: int, low: int, high: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(low, high))] for _ in range(n)]


def run_engine(llm: LLM, prompts: list[list[int]], output_len: int) -> Result:
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=2), use_tqdm=False)  # warm up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    ttft = [(o.metrics["first_token"] - o.metrics["arrival"]) * 1e3 for o in outputs]
    itl = [
        (o.metrics["finished"] - o.metrics["first_token"]) * 1e3 / (len(o.token_ids) - 1)
        for o in outputs
        if len(o.token_ids) > 1
    ]
    return Result(seconds, sum(len(o.token_ids) for o in outputs), ttft, itl)


def decode_overhead(llm: LLM, prompts: list[list[int]], steps: int = 16) -> tuple[float, float]:
    """Mean decode step time and the share of it spent outside the model's
    forward pass, with every prompt in the batch already prefilled."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"decode-{i}", p, params)
    while any(s.num_output_tokens == 0 for s in engine.requests.values()):
        engine.step()
    stats = engine.stats
    step0, fwd0 = stats.step_seconds, stats.forward_seconds
    for _ in range(steps):
        engine.step()
    step, fwd = stats.step_seconds - step0, stats.forward_seconds - fwd0
    while engine.has_unfinished_requests():
        engine.step()
    return step / steps, (step - fwd) / step


def run_transformers(
    path: str, prompts: list[list[int]], output_len: int, device: str, dtype: torch.dtype
) -> Result:
    """One padded batch through transformers' generate, greedy, fixed length."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as err:
        raise SystemExit("--compare-hf needs transformers (make test installs it)") from err
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad
    )
    with torch.inference_mode():
        model.generate(
            input_ids=ids[:2],
            attention_mask=mask[:2],
            **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2},
        )  # warm up
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
        seconds = time.perf_counter() - start
    return Result(seconds, (out.shape[1] - width) * len(prompts), [], [])


def kv_bytes_per_token_per_layer(llm: LLM) -> float:
    """What the engine's cache pool allocates per token, averaged over its layers."""
    pool = llm.llm_engine.executor.model_runner.kv_cache
    return pool.block_bytes() / pool.block_size / len(pool.specs)


def kv_cache_lines(llm: LLM, baselines: list[str]) -> list[str]:
    """Bytes per token and layer: this model's, a dense multi-head attention of the
    same width (every head's key and value, head_dim = hidden / heads), and the
    dense models named in ``baselines``, each loaded into a cache pool of its own."""
    cfg = llm.llm_engine.config
    hf = cfg.hf_config
    ours = kv_bytes_per_token_per_layer(llm)
    rows = [(f"this model ({hf.architecture})", ours)]
    if hf.mla is not None:
        rows[0] = (f"this model (MLA: {hf.mla.kv_lora_rank} + {hf.mla.qk_rope_head_dim})", ours)
        heads = hf.num_attention_heads
        mha = FullAttentionSpec(heads, hf.hidden_size // heads, cfg.dtype)
        rows.append((f"dense MHA, width {hf.hidden_size}", mha.block_bytes(1)))
    for path in baselines:
        other = LLM(path, device=cfg.device, dtype=cfg.dtype, num_kv_blocks=1)
        name = other.llm_engine.config.hf_config.architecture
        rows.append((f"{Path(path).name} ({name})", kv_bytes_per_token_per_layer(other)))
    lines = [f"KV cache per token and layer, {str(cfg.dtype).removeprefix('torch.')}:"]
    for name, value in rows:
        ratio = "" if value == ours else f"  {value / ours:5.2f}x this model's"
        lines.append(f"  {name:34}{value:8.0f} bytes{ratio}")
    return lines


def _ms(values: list[float]) -> str:
    return f"{statistics.mean(values):10.1f}" if values else f"{'-':>10}"


def run(
    model: str,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: int,
    compare_hf: bool,
    seed: int = 0,
    kv_baselines: list[str] | None = None,
    **llm_kwargs,
) -> str:
    llm = LLM(model, seed=seed, **llm_kwargs)
    cfg = llm.llm_engine.config
    hf = cfg.hf_config
    prompts = random_prompts(num_prompts, *input_len, hf.vocab_size, seed)
    ours = run_engine(llm, prompts, output_len)
    step_s, outside = decode_overhead(llm, prompts)
    lines = [
        f"model: {hf.architecture}, {hf.num_hidden_layers} layers, hidden {hf.hidden_size}, "
        f"vocab {hf.vocab_size}; {cfg.device}, {str(cfg.dtype).removeprefix('torch.')}, "
        f"{torch.get_num_threads()} threads",
        f"{num_prompts} prompts of {input_len[0]}-{input_len[1]} tokens "
        f"(mean {statistics.mean(map(len, prompts)):.0f}), {output_len} output tokens each",
        "",
        f"{'':24}{'engine':>10}{'transformers':>14}",
    ]
    theirs = (
        run_transformers(model, prompts, output_len, cfg.device, cfg.dtype) if compare_hf else None
    )
    rows = [
        (
            "output tokens/s",
            f"{ours.tokens_per_s:10.1f}",
            theirs and f"{theirs.tokens_per_s:14.1f}",
        ),
        ("total seconds", f"{ours.seconds:10.2f}", theirs and f"{theirs.seconds:14.2f}"),
        ("TTFT mean (ms)", _ms(ours.ttft_ms), theirs and f"{'-':>14}"),
        ("inter-token mean (ms)", _ms(ours.itl_ms), theirs and f"{'-':>14}"),
    ]
    lines += [f"{name:24}{a}{b or '':>14}" for name, a, b in rows]
    lines.append("")
    lines.append(
        f"decode step at batch {num_prompts}: {step_s * 1e3:.1f} ms, "
        f"{outside:.1%} of it outside the model forward"
    )
    if theirs:
        lines.append(
            f"engine / transformers output tokens/s: {ours.tokens_per_s / theirs.tokens_per_s:.2f}x"
        )
    lines += ["", *kv_cache_lines(llm, kv_baselines or [])]
    return "\n".join(lines)
