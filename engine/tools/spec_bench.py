"""`deepinfer bench --speculative-config JSON`: speculative decoding against
none, in the same process and run, at several batch sizes, on two kinds of
prompt: the book's own text (docs/*.md and engine/**/*.py, where prompt lookup
finds what comes next) and random tokens.

Each engine warms up on prompts unrelated to the timed ones; each repeat times
both engines, alternately, on the same fresh prompts (greedy, ignore_eos), so
that both see the same load. Reported: output tokens/s as a ratio to no
speculation (the best repeat's and the median's), the acceptance rate, the
mean accepted length (tokens per verify step, the bonus token included), a
request's target passes per output token, and the chosen-k distribution."""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from engine.config.speculative import SpeculativeConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.stats import EngineStats

ROOT = Path(__file__).resolve().parents[2]  # the checkout: docs/ and engine/


@dataclass
class Timed:
    tokens_per_s: float
    drafted: int
    accepted: int
    verify_steps: int
    tokens: int
    chosen: list[int]  # chosen_lengths' growth: how often each k was verified


def book_token_streams(llm: LLM) -> list[list[int]]:
    """The book's own text, a token list per file (chapters and engine code)."""
    files = sorted(ROOT.glob("docs/*.md")) + sorted(ROOT.glob("engine/**/*.py"))
    streams = [llm.tokenizer.encode(f.read_text()).ids for f in files]
    return [s for s in streams if len(s) > 64]


class Prompts:
    """Fresh prompts of ``length`` tokens for each repeat: windows of the book's
    files, or random tokens."""

    def __init__(self, kind: str, streams: list[list[int]], vocab: int, length: int) -> None:
        self.kind, self.vocab, self.length = kind, vocab, length
        self.streams = [s for s in streams if len(s) > length]  # whole windows only

    def draw(self, n: int, tag: str) -> list[list[int]]:
        rng = random.Random(f"{self.kind}/{tag}")
        if self.kind == "random":
            return [[rng.randrange(self.vocab) for _ in range(self.length)] for _ in range(n)]
        out = []
        for _ in range(n):
            s = rng.choice(self.streams)
            start = rng.randrange(max(1, len(s) - self.length))
            out.append(s[start : start + self.length])
        return out


def timed(llm: LLM, prompts: list[list[int]], output_len: int) -> Timed:
    """One greedy generate, with the engine's counters' change over it."""
    stats: EngineStats = llm.stats
    spec = stats.spec_decode
    before = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts)
    before_tokens = stats.generated_tokens
    before_chosen = list(spec.chosen_lengths)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = stats.generated_tokens - before_tokens
    after = (spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_drafts)
    d = [a - b for a, b in zip(after, before)]
    chosen = [n - (before_chosen[k] if k < len(before_chosen) else 0)
              for k, n in enumerate(spec.chosen_lengths)]  # fmt: skip
    return Timed(tokens / seconds, d[0], d[1], d[2], tokens, chosen)


def compare(
    plain: LLM, spec: LLM, prompts: Prompts, batch: int, output_len: int, repeats: int
) -> str:
    """One line: speculation against none at ``batch``, on ``prompts``."""
    for llm in (plain, spec):
        llm.generate(
            prompts.draw(batch, f"warm/{batch}"), SamplingParams(max_tokens=4), use_tqdm=False
        )
    ratios, runs = [], []
    for r in range(repeats):
        work = prompts.draw(batch, f"{batch}/{r}")
        base = timed(plain, work, output_len)
        run = timed(spec, work, output_len)
        ratios.append(run.tokens_per_s / base.tokens_per_s)
        runs.append((base, run))
    best = max(range(repeats), key=lambda i: ratios[i])
    base, run = runs[best]
    drafted = sum(s.drafted for _, s in runs)
    accepted = sum(s.accepted for _, s in runs)
    verifies = sum(s.verify_steps for _, s in runs)
    rate = accepted / drafted if drafted else 0.0
    length = 1 + accepted / verifies if verifies else 1.0
    tokens = sum(s.tokens for _, s in runs)
    passes = (tokens - accepted) / tokens  # a request's target passes per output token
    return (
        f"{prompts.kind:>7} {batch:>5} {base.tokens_per_s:>10.0f} {run.tokens_per_s:>10.0f} "
        f"{ratios[best]:>6.2f}x {statistics.median(ratios):>6.2f}x {rate:>7.1%} "
        f"{length:>6.2f} {passes:>8.3f}  {k_shares([s for _, s in runs])}"
    )


def k_shares(runs: list[Timed]) -> str:
    """The chosen k's distribution over all repeats, as k:share% for each k chosen."""
    width = max(len(r.chosen) for r in runs)
    counts = [sum(r.chosen[k] for r in runs if k < len(r.chosen)) for k in range(width)]
    total = sum(counts)
    return " ".join(f"{k}:{c / total:.0%}" for k, c in enumerate(counts) if c) if total else "-"


def run(
    model: str,
    speculative_config: str,
    batches: list[int],
    input_len: int,
    output_len: int,
    repeats: int = 3,
    **llm_kwargs,
) -> str:
    config = SpeculativeConfig.parse(speculative_config)
    most = max(batches)
    blocks = most * ((input_len + output_len + config.num_speculative_tokens) // 16 + 2) + 64
    kwargs = dict(llm_kwargs, max_num_seqs=most, num_kv_blocks=blocks, block_size=16)
    plain = LLM(model, **kwargs)
    spec = LLM(model, speculative_config=config, **kwargs)
    vocab = plain.llm_engine.config.hf_config.vocab_size
    streams = book_token_streams(plain)
    lines = [
        f"speculative decoding: {config}",
        f"{input_len}-token prompts, {output_len} greedy output tokens each, {repeats} "
        "repeats on fresh prompts, both engines in this process, timed alternately",
        "",
        f"{'prompts':>7} {'batch':>5} {'plain t/s':>10} {'spec t/s':>10} {'best':>7} "
        f"{'median':>7} {'accept':>7} {'length':>6} {'pass/tok':>8}  chosen k",
    ]
    for kind in ("book", "random"):
        prompts = Prompts(kind, streams, vocab, input_len)
        for batch in batches:
            lines.append(compare(plain, spec, prompts, batch, output_len, repeats))
    lines += [
        "",
        "best/median: spec t/s over plain t/s (the best repeat's, the median's); accept: "
        "accepted / drafted; length: tokens per verify step (accepted drafts + 1); "
        "pass/tok: a request's target passes per output token, (tokens - accepted) / "
        "tokens, 1 without speculation (all repeats); chosen k: how often a request given "
        "drafts verified k of them",
    ]
    return "\n".join(lines)
