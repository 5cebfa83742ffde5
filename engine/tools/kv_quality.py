"""`deepinfer bench --kv-quality`: what each approximate KV cache costs in quality,
and what it saves in bytes, on the repository's tiny models.

For each model, each cache is one row:

- exact: the model's dtype (kv_cache_dtype "auto");
- fp8_e4m3 and int8: one byte a number, with float32 scales (engine/kv/quant.py);
  on the MLA model, the latent in FlashMLA's V3.2 layout;
- window: a sliding window with attention sinks (kv_window), which gives back
  the blocks between the sinks and the last ``window`` tokens;
- and, on a tiny random DeepSeek-V3.2 (the shape of tests/engine/test_dsa.py),
  DSA with index_topk well below the context against the same weights dense
  (index_topk at the model's length, so that every query keeps every token).

The columns:

- held-out perplexity, exp(mean NLL) from prompt_logprobs over text the tiny
  models were not trained on: a file snippets/models/train_tiny.py held out, as it
  stood at the corpus commit the models were trained from (records.json), cut in
  windows of ``context`` tokens. The window row scores in chunks of one block
  (max_num_batched_tokens = block_size), so that blocks really go back between
  a window's chunks; the other rows score each window as one prompt;
- two 95% intervals from one bootstrap over the windows (the same resampled
  windows for every row of a table, seeded): the perplexity's own, which says how
  much another sample of text would move it, and its gap to the table's first
  row (exact, or dense), paired window by window, which says whether a cache
  moved perplexity at all: every row reads the same text, so the text's own
  spread cancels in the gap;
- greedy agreement with the exact cache (for DSA, with dense): over a few
  prompts taken from the same text, the share of generated positions whose
  token equals the reference's, and the first position (from 0, the earliest
  over the prompts) where one differs; the reference is a separate run of the
  exact cache, so the exact row checks that a run repeats itself. Free-running,
  one flipped token changes every later one's context, so this share counts
  the positions after the first flip as lost whatever the cache does there;
- teacher-forced top-1 agreement: the reference's replies fed back as prompts
  through the cache, and the share of their positions where the cache's most
  likely token is the reference's own; every position has the reference's
  context, so a flip costs one position and no more;
- KV bytes per token from the engine's own pool (block_bytes() / block_size,
  every layer), and its ratio to exact's; and the most blocks one request held
  during the generation, where the window's saving shows.

Float32, greedy, one torch thread, and every random number seeded: the figures
are deterministic on one machine. measure() returns the rows as QualityRow dataclasses.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engine.llm import LLM
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler_output import HOLE

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "snippets" / "models"
DEFAULT_MODELS = (MODELS / "deepinfer-tiny", MODELS / "deepinfer-tiny-moe")
HELDOUT_FILE = "docs/ch01-batching-and-the-kv-cache.md"  # held out by train_tiny.py
DSA_MODEL = "random V3.2"
DSA_LENGTH = 1024  # the random V3.2's max_position_embeddings: dense keeps every token


@dataclass(frozen=True)
class Sizes:
    """How much is measured. The defaults are the table `deepinfer bench
    --kv-quality` prints; a test passes smaller ones."""

    context: int = 256  # tokens per scored window: the tiny models' training length
    heldout_tokens: int | None = None  # None: the whole held-out file
    num_prompts: int = 4
    prompt_len: int = 64
    gen_tokens: int = 256
    block_size: int = 16
    window: tuple[int, int] = (4, 64)  # (sinks, window): it bites well inside a context
    index_topk: int = 32  # DSA's: well below the context


@dataclass(frozen=True)
class Cache:
    """One row's engine: its cache settings, and the model folder it loads."""

    label: str
    model: Path
    kv_cache_dtype: str = "auto"
    kv_window: tuple[int, int] | None = None

    @property
    def chunked(self) -> bool:
        """Score in one-block chunks, so that a window gives blocks back between them."""
        return self.kv_window is not None


@dataclass(frozen=True)
class QualityRow:
    model: str
    cache: str
    perplexity: float  # held out, exp(mean NLL)
    perplexity_interval: tuple[float, float]  # 95%, bootstrap over windows
    gap_interval: tuple[float, float]  # 95% of perplexity - the first row's, paired
    agreement: float  # share of generated positions equal to the reference's
    first_difference: int | None  # earliest generated position that differs; None: none
    forced_agreement: float  # share of the reference's positions that are our top 1
    bytes_per_token: float  # the pool's, over every layer
    bytes_ratio: float  # to the table's first row (exact, or dense for DSA)
    peak_blocks: int  # the most blocks one request held while generating


@dataclass
class Run:
    outputs: list[RequestOutput]
    peak_blocks: int


def text_at(path: str, commit: str) -> str:
    """A file of this repository as ``commit`` had it, so that a demo reading the
    book's own text does not change when the text is edited."""
    shown = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{commit}:{path}"], capture_output=True, text=True
    )
    if shown.returncode != 0:
        raise RuntimeError(f"git cannot show {path} at {commit[:12]}: {shown.stderr.strip()}")
    return shown.stdout


def heldout_text() -> tuple[str, str]:
    """The held-out file as the tiny models' corpus commit had it, and where it came
    from; the working tree's copy (also never trained on) if git cannot show it."""
    commit = json.loads((MODELS / "records.json").read_text())["corpus"]["commit"]
    try:
        return text_at(HELDOUT_FILE, commit), f"{HELDOUT_FILE} at {commit[:12]}"
    except RuntimeError:
        return (ROOT / HELDOUT_FILE).read_text(), f"{HELDOUT_FILE} (working tree)"


def windows(token_ids: list[int], sizes: Sizes) -> list[list[int]]:
    """The scored windows: ``context`` tokens each, the last one possibly shorter."""
    ids = token_ids[: sizes.heldout_tokens]
    cut = [ids[i : i + sizes.context] for i in range(0, len(ids), sizes.context)]
    return [w for w in cut if len(w) > 1]


def drive(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> Run:
    """LLM.generate's loop, noting the most blocks any request holds after a step."""
    engine, peak = llm.llm_engine, 0
    ids = [f"q{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        for seq in engine.requests.values():
            peak = max(peak, sum(b != HOLE for b in seq.block_table))
    return Run([done[i] for i in ids], peak)


@dataclass(frozen=True)
class WindowScore:
    """One scored window: its summed NLL over the tokens it scores, and how many."""

    nll: float
    tokens: int


def window_scores(outputs: list[RequestOutput]) -> list[WindowScore]:
    """Each window's NLL of every scored prompt token (all but the window's first)."""
    return [
        WindowScore(
            -sum(entry[token] for token, entry in zip(out.prompt_token_ids[1:], logprobs)),
            len(out.prompt_token_ids) - 1,
        )
        for out in outputs
        for logprobs in [out.prompt_logprobs[1:]]
    ]


def perplexity(scores: Sequence[WindowScore]) -> float:
    """exp(mean NLL) over the windows' tokens."""
    return math.exp(sum(s.nll for s in scores) / sum(s.tokens for s in scores))


DRAWS = 2000  # bootstrap resamples
LEVEL = 0.95  # the share of them an interval holds


def resamples(windows: int, draws: int = DRAWS, seed: int = 0) -> list[list[int]]:
    """The bootstrap's draws of window indices, with replacement, seeded: every
    row of a table is resampled with the same draws, so its gap is paired."""
    rng = random.Random(seed)
    return [[rng.randrange(windows) for _ in range(windows)] for _ in range(draws)]


def interval(values: list[float]) -> tuple[float, float]:
    """The central LEVEL of a bootstrap's values."""
    ordered, tail = sorted(values), (1 - LEVEL) / 2
    return ordered[int(tail * len(ordered))], ordered[int((1 - tail) * len(ordered)) - 1]


def bootstrap(
    ours: Sequence[WindowScore], reference: Sequence[WindowScore], draws: list[list[int]]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """95% intervals of our perplexity, and of its gap to the reference's."""
    ppl, gap = [], []
    for pick in draws:
        mine = perplexity([ours[i] for i in pick])
        ppl.append(mine)
        gap.append(mine - perplexity([reference[i] for i in pick]))
    return interval(ppl), interval(gap)


def agreement(ours: list[list[int]], reference: list[list[int]]) -> tuple[float, int | None]:
    """The share of positions with the reference's token, and the earliest that differs."""
    same = total = 0
    first: int | None = None
    for a, b in zip(ours, reference):
        same += sum(x == y for x, y in zip(a, b))
        total += len(b)
        where = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if where is not None and (first is None or where < first):
            first = where
    return same / total, first


def engine_for(cache: Cache, sizes: Sizes, chunked: bool) -> LLM:
    chunk = {"max_num_batched_tokens": sizes.block_size} if chunked else {}
    return LLM(
        cache.model,
        dtype="float32",
        block_size=sizes.block_size,
        kv_cache_dtype=cache.kv_cache_dtype,
        kv_window=cache.kv_window,
        seed=0,
        **chunk,
    )


def forced_agreement(llm: LLM, prompts: list[list[int]], replies: list[list[int]]) -> float:
    """Teacher-forced: each prompt and its reference reply scored as one prompt; the
    share of reply positions where our most likely token is the reference's."""
    top1 = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outputs = drive(llm, [p + r for p, r in zip(prompts, replies)], top1).outputs
    same = total = 0
    for prompt, reply, out in zip(prompts, replies, outputs):
        entries = out.prompt_logprobs[len(prompt) : len(prompt) + len(reply)]
        same += sum(max(e, key=e.__getitem__) == t for t, e in zip(reply, entries))
        total += len(reply)
    return same / total


def generate(cache: Cache, sizes: Sizes, prompts: list[list[int]]) -> Run:
    greedy = SamplingParams(temperature=0, max_tokens=sizes.gen_tokens, ignore_eos=True)
    return drive(engine_for(cache, sizes, chunked=False), prompts, greedy)


def measure_table(name: str, caches: Sequence[Cache], sizes: Sizes) -> list[QualityRow]:
    """One model's rows; the first cache is the reference for agreement and bytes."""
    tokenizer = Tokenizer.from_file(str(caches[0].model / "tokenizer.json"))
    scored = windows(tokenizer.encode(heldout_text()[0]).ids, sizes)
    prompts = [w[: sizes.prompt_len] for w in scored[: sizes.num_prompts]]
    reference = [o.token_ids for o in generate(caches[0], sizes, prompts).outputs]
    score = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    draws = resamples(len(scored))
    rows: list[QualityRow] = []
    first_scores: list[WindowScore] = []
    for cache in caches:
        llm = engine_for(cache, sizes, cache.chunked)
        scores = window_scores(drive(llm, scored, score).outputs)
        first_scores = first_scores or scores
        ppl_interval, gap_interval = bootstrap(scores, first_scores, draws)
        forced = forced_agreement(llm, prompts, reference)
        pool = llm.llm_engine.executor.model_runner.kv_cache
        per_token = pool.block_bytes() / pool.block_size
        run = generate(cache, sizes, prompts)
        share, first = agreement([o.token_ids for o in run.outputs], reference)
        ratio = per_token / rows[0].bytes_per_token if rows else 1.0
        rows.append(
            QualityRow(
                name,
                cache.label,
                perplexity(scores),
                ppl_interval,
                gap_interval,
                share,
                first,
                forced,
                per_token,
                ratio,
                run.peak_blocks,
            )
        )
    return rows


def caches_for(model: Path, sizes: Sizes) -> list[Cache]:
    sinks, window = sizes.window
    return [
        Cache("exact", model),
        Cache("fp8_e4m3", model, kv_cache_dtype="fp8_e4m3"),
        Cache("int8", model, kv_cache_dtype="int8"),
        Cache(f"window {sinks}+{window}", model, kv_window=sizes.window),
    ]


@contextmanager
def random_v32(sizes: Sizes) -> Iterator[tuple[Path, Path]]:
    """A tiny random DeepseekV32ForCausalLM with deepinfer-tiny's tokenizer, saved
    twice: index_topk = sizes.index_topk (DSA), and at the model's length (dense)."""
    try:
        import transformers
    except ImportError as err:
        raise SystemExit("the DSA rows build a random V3.2 with transformers") from err
    tokenizer = DEFAULT_MODELS[0]
    vocab = json.loads((tokenizer / "config.json").read_text())["vocab_size"]
    config = transformers.DeepseekV32Config(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,  # a dense layer, then a MoE layer
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=DSA_LENGTH,
        initializer_range=0.1,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=0,
        tie_word_embeddings=False,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        index_topk=sizes.index_topk,
        index_n_heads=16,
        index_head_dim=32,
    )
    with tempfile.TemporaryDirectory() as folder:
        dsa, dense = Path(folder) / "dsa", Path(folder) / "dense"
        torch.manual_seed(0)
        model = transformers.DeepseekV32ForCausalLM(config).eval()
        with torch.no_grad():  # transformers starts these at ones and zeros: make them count
            for layer in model.model.layers:
                layer.self_attn.indexer.k_norm.weight.normal_(1, 0.1)
                layer.self_attn.indexer.k_norm.bias.normal_(0, 0.1)
            model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
        model.save_pretrained(dsa)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer / name).is_file():
                shutil.copy(tokenizer / name, dsa / name)
        shutil.copytree(dsa, dense)
        dense_config = json.loads((dense / "config.json").read_text())
        dense_config["index_topk"] = DSA_LENGTH
        (dense / "config.json").write_text(json.dumps(dense_config, indent=2))
        yield dsa, dense


def measure(
    models: Sequence[Path] = DEFAULT_MODELS, dsa: bool = True, sizes: Sizes | None = None
) -> list[QualityRow]:
    """Every row of every table: each model's caches, then DSA against dense. On
    one torch thread, so that the figures do not depend on the machine's cores
    (a matmul's sums run in an order that follows the thread count)."""
    sizes = sizes or Sizes()
    rows: list[QualityRow] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for model in map(Path, models):
            rows += measure_table(model.name, caches_for(model, sizes), sizes)
        if dsa:
            with random_v32(sizes) as (sparse, dense):
                caches = [
                    Cache("dense", dense),
                    Cache(f"DSA top-k {sizes.index_topk}", sparse),
                ]
                rows += measure_table(DSA_MODEL, caches, sizes)
    finally:
        torch.set_num_threads(threads)
    return rows


def header(sizes: Sizes) -> str:
    sinks, window = sizes.window
    return "\n".join(
        [
            f"KV cache quality, float32, greedy, one thread; held out: {heldout_text()[1]}",
            f"perplexity over windows of {sizes.context} tokens"
            + (f" (the first {sizes.heldout_tokens})" if sizes.heldout_tokens else "")
            + f"; the window ({sinks} sinks, {window} recent) scored in chunks of one"
            f" {sizes.block_size}-token block, so that blocks go back between chunks",
            f"95%: bootstrap over the windows ({DRAWS} draws); gap: perplexity minus the"
            " first row's, paired window by window",
            f"agreement: {sizes.num_prompts} prompts of {sizes.prompt_len} held-out tokens,"
            f" {sizes.gen_tokens} greedy tokens each, against a separate exact run"
            f" (DSA: against dense, index_topk {DSA_LENGTH}, every token); free: greedy"
            " replies, forced: our top 1 along the reference's replies",
            "bytes/token: the pool's, every layer (V3.2: the indexer's keys beside the"
            " latent, in both rows); peak blocks: the most one request held while generating",
        ]
    )


def format_rows(rows: Sequence[QualityRow]) -> str:
    lines: list[str] = []
    for model in dict.fromkeys(r.model for r in rows):
        lines += ["", model]
        lines.append(
            f"  {'cache':<14}{'perplexity':>11}{'95%':>18}{'gap 95%':>18}{'free':>7}"
            f"{'first differs':>14}{'forced':>7}{'bytes/token':>12}{'ratio':>7}{'peak blocks':>12}"
        )
        for r in (r for r in rows if r.model == model):
            first = "-" if r.first_difference is None else str(r.first_difference)
            (low, high), (gap_low, gap_high) = r.perplexity_interval, r.gap_interval
            lines.append(
                f"  {r.cache:<14}{r.perplexity:>11.2f}{f'{low:.2f}..{high:.2f}':>18}"
                f"{f'{gap_low:+.2f}..{gap_high:+.2f}':>18}{r.agreement:>7.3f}{first:>14}"
                f"{r.forced_agreement:>7.3f}{r.bytes_per_token:>12.1f}{r.bytes_ratio:>7.3f}"
                f"{r.peak_blocks:>12}"
            )
    return "\n".join(lines)


def run(models: Sequence[Path] | None = None, sizes: Sizes | None = None) -> str:
    """The tables `deepinfer bench --kv-quality` prints."""
    sizes = sizes or Sizes()
    rows = measure(models or DEFAULT_MODELS, dsa=True, sizes=sizes)
    return header(sizes) + "\n" + format_rows(rows)
