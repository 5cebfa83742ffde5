"""A sliding KV window with attention sinks (EngineConfig.kv_window).

A request keeps the blocks holding its first ``sinks`` tokens and its last
``window`` computed ones, and gives back every block between while it runs.
The tests check the block manager's books after every step of a randomized run
(preemption, prefix caching and chunked prefill included, with and without
async scheduling, and under n-gram speculation), the bound on a request's blocks
over a 2,000-token generation, that a window larger than the context changes no
token, and that a window that bites gives exactly the tokens of a float64
transformers model told by an explicit attention mask which positions each query
keeps. Bad settings fail at construction.

The bound. At a step that computes ``n`` tokens (drafts included) after the
``C`` already computed, the request holds the S = cdiv(sinks, bs) sink blocks
and the blocks from (C - window) // bs up to cdiv(C + n, bs). Writing C - window
= q * bs + r with 0 <= r < bs, the second run has cdiv(r + window + n, bs)
blocks, at most cdiv(bs - 1 + window + n, bs) = cdiv(window + n - 1, bs) + 1.
Before anything is given back the request holds cdiv(C + n, bs) blocks, with
q <= S, which is no more. So: held <= S + cdiv(window + n - 1, bs) + 1, with
equality whenever r = bs - 1 once blocks are being given back.
"""

from __future__ import annotations

import random
import textwrap
from collections import Counter
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.llm_engine import LLMEngine
from engine.scheduler_output import HOLE, SchedulerOutput
from engine.sequence import Sequence
from engine.tools.cli import build_parser, serve_engine_config
from engine.utils import cdiv
from tests.engine.conftest import build_tokenizer, hf_config, hf_model_class
from tests.engine.test_triton_backend import run

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(autouse=True)
def one_thread():
    """Thousands of tiny steps: one torch thread, which a busy machine slows least."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> Path:
    """conftest's tiny random Llama (GQA, llama3 RoPE), allowed 2,304 positions."""
    path = tmp_path_factory.mktemp("llama-long")
    torch.manual_seed(0)
    config = hf_config("llama")
    config.max_position_embeddings = 2304
    hf_model_class("llama")(config).eval().save_pretrained(path)
    build_tokenizer(path)
    return path


def bound(block_size: int, kv_window: tuple[int, int], n: int) -> int:
    """The most blocks a request may hold at a step that computes ``n`` tokens."""
    sinks, window = kv_window
    return cdiv(sinks, block_size) + cdiv(window + n - 1, block_size) + 1


def held(seq: Sequence) -> list[int]:
    return [b for b in seq.block_table if b != HOLE]


def check_books(engine: LLMEngine) -> None:
    """The block manager's invariants, with every unfinished request's table."""
    bm, (sinks, window) = engine.block_manager, engine.config.kv_window
    bs, seqs = bm.block_size, list(engine.scheduler.requests.values())
    holders = Counter(b for seq in seqs for b in held(seq))
    assert all(block.ref_count == holders[block.block_id] for block in bm.blocks)
    free = set(bm.free_blocks)
    assert free.isdisjoint(holders) and free | set(holders) == set(range(len(bm.blocks)))
    for h, block_id in bm.cached_blocks.items():
        assert bm.blocks[block_id].hash == h
    for block in bm.blocks:
        assert block.hash is None or bm.cached_blocks[block.hash] == block.block_id
    for seq in seqs:
        holes = [i for i, b in enumerate(seq.block_table) if b == HOLE]
        first = cdiv(sinks, bs)
        assert holes == list(range(first, first + len(holes)))  # one run, after the sinks
        if holes:  # wholly before the window, and nothing hashed after the first drop
            assert (holes[-1] + 1) * bs <= seq.num_computed_tokens - window
            assert len(seq.block_hashes) * bs <= seq.num_unwindowed_tokens
        for i, h in enumerate(seq.block_hashes):
            if seq.block_table[i] != HOLE:
                block = bm.blocks[seq.block_table[i]]
                assert block.hash in (None, h)  # None: a twin another request published
                if block.hash is not None:
                    assert block.token_ids == tuple(seq.token_ids[i * bs : (i + 1) * bs])


def watch_schedule(engine: LLMEngine, peaks: dict[str, int]) -> None:
    """After every schedule, each scheduled request holds no more than the bound
    for the tokens it computes; ``peaks`` keeps the most each ever held."""
    scheduler, schedule = engine.scheduler, engine.scheduler.schedule
    bs, kv_window = engine.block_manager.block_size, engine.config.kv_window

    def checked() -> SchedulerOutput:
        out = schedule()
        for item in out.scheduled:
            n = len(held(scheduler.requests[item.req_id]))
            assert n <= bound(bs, kv_window, item.num_new_tokens), (item.req_id, n)
            peaks[item.req_id] = max(peaks.get(item.req_id, 0), n)
        return out

    scheduler.schedule = checked


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_books_hold_after_every_step_of_a_random_run(
    long_llama: Path, async_scheduling: bool
) -> None:
    """Twelve requests, four sharing a system prompt and two asking again for an
    earlier prompt, arrive over the first steps into a cache of 24 blocks of 4,
    with prompts chunked to 24 tokens, a window of (5, 10) and prefix caching."""
    rng = random.Random(3)
    llm = LLM(
        long_llama,
        dtype="float32",
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=24,
        max_num_seqs=6,
        kv_window=(5, 10),
        async_scheduling=async_scheduling,
    )
    engine, peaks = llm.llm_engine, {}
    watch_schedule(engine, peaks)
    system = [rng.randrange(3, 320) for _ in range(14)]
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(3, 40))] for _ in range(10)]
    prompts = [system + p if i < 4 else p for i, p in enumerate(prompts)]
    prompts += [prompts[1], prompts[6]]
    arrivals = sorted((rng.randint(0, 30), i) for i in range(len(prompts)))
    step = 0
    while arrivals or engine.has_unfinished_requests():
        while arrivals and arrivals[0][0] <= step:
            _, i = arrivals.pop(0)
            params = SamplingParams(max_tokens=rng.randint(5, 60), **GREEDY)
            engine.add_request(str(i), prompts[i], params)
        if engine.has_unfinished_requests():
            engine.step()
            check_books(engine)
        step += 1
    stats = llm.stats
    assert stats.preemptions > 0 and stats.prefix_cache_hit_tokens > 0  # what it claims
    assert stats.window_freed_blocks > 0 and stats.finished_requests == len(prompts)
    assert engine.block_manager.num_free_blocks == 24  # every block given back
    assert len(peaks) == len(prompts)


def test_a_2000_token_generation_stays_at_its_bound(long_llama: Path) -> None:
    """One greedy request of 40 prompt tokens and 2,000 generated, blocks of 16, a
    window of (4, 50), in a cache of 16 blocks (256 tokens): the engine accepts
    the checkpoint's whole length, since a lone request holds only its sinks', its
    window's and one step's blocks; after every schedule it holds at most the
    bound, and the cache has no other block in use; the bound is reached; and the
    blocks given back are exactly those between its one sink block and its last
    window."""
    bs, kv_window, prompt_len, out_len = 16, (4, 50), 40, 2000
    llm = LLM(
        long_llama,
        dtype="float32",
        block_size=bs,
        num_kv_blocks=16,
        max_num_batched_tokens=64,
        kv_window=kv_window,
    )
    assert llm.llm_engine.max_model_len == 2304 > 16 * bs
    engine, peaks, in_use = llm.llm_engine, {}, []
    watch_schedule(engine, peaks)
    engine.add_request(
        "long", list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=out_len, **GREEDY)
    )
    while engine.has_unfinished_requests():
        engine.step()
        check_books(engine)
        in_use.append(len(engine.block_manager.blocks) - engine.block_manager.num_free_blocks)
    limit = bound(bs, kv_window, 1)  # a decode step's; the prompt's single step needs fewer
    assert peaks["long"] == limit == 6
    assert max(in_use) <= limit
    last_computed = prompt_len + out_len - 2  # the last step computes the 1,999th output token
    sink_blocks = cdiv(kv_window[0], bs)
    assert llm.stats.window_freed_blocks == (last_computed - kv_window[1]) // bs - sink_blocks


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_a_window_larger_than_the_context_changes_no_token(
    model: str, long_llama: Path, deepseek: tuple[Path, object]
) -> None:
    """Greedy outputs of three prompts are token-identical with a window of 512
    tokens and without one, chunked and with n-gram drafts too, on GQA and MLA,
    and nothing is given back."""
    path = long_llama if model == "llama" else deepseek[0]
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 320) for _ in range(n)] for n in (7, 33, 60)]
    prompts[2] = prompts[2][:20] * 3  # repeats, for the n-gram proposer
    params = SamplingParams(max_tokens=40, **GREEDY)
    common = dict(dtype="float32", block_size=4, max_num_batched_tokens=32)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    for extra in ({}, {"speculative_config": spec}):
        outs = []
        for kv_window in (None, (2, 512)):
            llm = LLM(path, **common, **extra, kv_window=kv_window)
            outs.append([o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.stats.window_freed_blocks == 0
        assert outs[0] == outs[1]


def kept_mask(chunk_starts: list[int], bs: int, kv_window: tuple[int, int]) -> torch.Tensor:
    """[positions, positions] True where query q sees key j, for tokens whose keys
    were computed in steps that began with ``chunk_starts[q]`` tokens computed:
    causal, less the blocks the window had given back by then."""
    sinks, window = kv_window
    n = len(chunk_starts)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for q, start in enumerate(chunk_starts):
        for j in range(q + 1):
            mask[q, j] = not (cdiv(sinks, bs) <= j // bs < (start - window) // bs)
    return mask


@pytest.mark.parametrize(
    ("model", "budget", "backend"),
    [("llama", 8192, "torch"), ("llama", 16, "cpu"), ("deepseek", 16, "torch")],
)
def test_a_window_that_bites_gives_the_tokens_of_a_masked_reference(
    model: str, budget: int, backend: str, long_llama: Path, deepseek: tuple[Path, object]
) -> None:
    """A 37-token prompt, 60 greedy tokens, blocks of 4, a window of (3, 12): the
    engine's tokens equal the argmax of transformers in float64 at each position,
    given a 4-D mask that keeps, for each query, the sinks' blocks and the blocks
    the engine still held when the query's step began (prompt chunks of
    ``budget`` tokens, then one step per token). Without the mask far fewer agree."""
    path = long_llama if model == "llama" else deepseek[0]
    bs, kv_window, prompt_len, out_len = 4, (3, 12), 37, 60
    prompt = random.Random(7).choices(range(3, 320), k=prompt_len)
    llm = LLM(
        path,
        dtype="float32",
        block_size=bs,
        max_num_batched_tokens=budget,
        attention_backend=backend,
        kv_window=kv_window,
    )
    out = llm.generate([prompt], SamplingParams(max_tokens=out_len, **GREEDY), use_tqdm=False)
    tokens = out[0].token_ids
    assert llm.stats.window_freed_blocks > 0
    seq = prompt + tokens[:-1]
    starts = [p // budget * budget for p in range(prompt_len)] + list(range(prompt_len, len(seq)))
    mask = kept_mask(starts, bs, kv_window)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float64, attn_implementation="eager", experts_implementation="eager"
    )
    additive = torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
    with torch.no_grad():
        logits = ref.eval()(torch.tensor([seq]), attention_mask=additive[None, None]).logits[0]
        causal = ref(torch.tensor([seq])).logits[0]
    assert logits[prompt_len - 1 :].argmax(-1).tolist() == tokens
    unmasked = causal[prompt_len - 1 :].argmax(-1).tolist()
    assert sum(a == b for a, b in zip(unmasked, tokens)) < out_len // 2


TRITON_SCRIPT = textwrap.dedent(
    """
    import random, sys
    from engine import LLM, SamplingParams

    prompt = random.Random(7).choices(range(3, 320), k=37)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    tokens, freed = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(sys.argv[1], dtype="float32", block_size=4, max_num_batched_tokens=16,
                  attention_backend=backend, kv_window=(3, 12))
        outs = llm.generate([prompt, prompt[:9]], params, use_tqdm=False)
        tokens[backend], freed[backend] = [o.token_ids for o in outs], llm.stats.window_freed_blocks
    assert tokens["torch"] == tokens["triton"], tokens
    assert freed["torch"] == freed["triton"] > 0, freed
    print("identical", freed["triton"])
    """
)


@pytest.mark.triton
def test_the_triton_kernels_read_the_kept_blocks_as_torch_does(long_llama: Path) -> None:
    """Under Triton's interpreter: a window that bites, through chunked prefill and
    decode, gives the torch backend's tokens (which the masked reference checks)."""
    proc = run(TRITON_SCRIPT, str(long_llama), interpret=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("identical")


def test_speculation_stays_within_the_bound_of_its_verify_steps(long_llama: Path) -> None:
    """n-gram drafts on a repeating prompt, with a window of (0, 8): every verify
    step holds at most the bound for its 1 + k tokens, drafts are both accepted
    and rejected (rolled back with free_tail), and the books hold throughout."""
    llm = LLM(
        long_llama,
        dtype="float32",
        block_size=4,
        kv_window=(0, 8),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    engine, peaks = llm.llm_engine, {}
    watch_schedule(engine, peaks)
    prompt = random.Random(2).choices(range(3, 320), k=12) * 4
    engine.add_request("spec", prompt, SamplingParams(max_tokens=80, **GREEDY))
    while engine.has_unfinished_requests():
        engine.step()
        check_books(engine)
    spec = llm.stats.spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens
    assert llm.stats.window_freed_blocks > 0


@pytest.mark.parametrize(
    ("kv_window", "match"),
    [
        ((4, 3), r"kv_window \(sinks=4, window=3\) needs sinks >= 0 and a window of at least"),
        ((-1, 64), "kv_window"),
        ((4,), "kv_window must be a pair of integers"),
        ((4.0, 64), "kv_window must be a pair of integers"),
    ],
)
def test_bad_windows_fail_at_construction(long_llama: Path, kv_window, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(long_llama, block_size=4, kv_window=kv_window)


def test_a_window_refuses_mtp_drafts(deepseek: tuple[Path, object]) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="kv_window does not support speculative_config method"):
        LLM(deepseek[0], kv_window=(4, 64), speculative_config=spec)


def test_the_command_line_takes_a_window(long_llama: Path) -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", str(long_llama), "--kv-window", "4,64"])
    assert serve_engine_config(args).kv_window == (4, 64)
    assert parser.parse_args(["serve", str(long_llama)]).kv_window is None
    for command in (["generate", "x", "--model", "m"], ["bench", "--model", "m"]):
        assert parser.parse_args([*command, "--kv-window", "0,16"]).kv_window == (0, 16)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", str(long_llama), "--kv-window", "64"])
