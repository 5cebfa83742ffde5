"""Batch-invariant mode: one request's logits are bitwise the same (torch.equal,
not allclose) whatever shares its steps, on the torch backend and on the Triton
kernels under the interpreter. With the mode off they are not, on this CPU:
the control shows that the scenarios do perturb the batch."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.attention.metadata import AttentionMetadata, one_query_per_row
from engine.layers.batch_invariant import ROW_TILE, linear
from tests.conftest import ROOT
from tests.engine.invariance import compare, scenarios

TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"


def test_logits_are_bitwise_equal_in_any_company() -> None:
    same = compare(scenarios(TINY, batch_invariant=True))
    assert all(same.values()), same


def test_without_the_mode_company_changes_the_bits() -> None:
    """The control: the same scenarios, mode off on the same torch backend, do
    change the target's logits."""
    chosen = ("alone", "behind 3", "chunked by 16")
    runs = scenarios(TINY, attention_backend="torch")
    same = compare({k: v for k, v in runs.items() if k in chosen})
    assert not all(same.values()), same


def test_a_row_gets_the_same_bits_in_any_tile_and_any_position() -> None:
    g = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    row = torch.randn(64, generator=g)
    alone = linear(row[None], weight, bias)[0]
    for n in (2, ROW_TILE - 1, ROW_TILE, 3 * ROW_TILE + 5):
        for at in {0, n // 2, n - 1}:
            batch = torch.randn(n, 64, generator=g)
            batch[at] = row
            assert torch.equal(linear(batch, weight, bias)[at], alone), (n, at)


# A row of a [n, 1024] @ [1024, 256] product (the tiny models' down projection),
# alone and in batches; MKL reads its ISA and thread count once, at start-up.
THREADS_SCRIPT = textwrap.dedent(
    """
    import torch
    from engine.layers.batch_invariant import linear
    g = torch.Generator().manual_seed(0)
    weight, x = torch.randn(256, 1024, generator=g), torch.randn(200, 1024, generator=g)
    alone = linear(x[:1], weight)[0]
    print(sum(torch.equal(linear(x[:n], weight)[0], alone) for n in (2, 17, 40, 64, 200)))
    """
)


@pytest.mark.parametrize("isa", ["AVX2", "AVX512"])
def test_a_row_keeps_its_bits_on_two_threads(isa: str) -> None:
    """MKL's AVX2 batched product on two threads changed a row's bits once the
    batch held two tiles; one product per tile does not."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MKL_ENABLE_INSTRUCTIONS": isa,
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
    }
    proc = subprocess.run(
        [sys.executable, "-c", THREADS_SCRIPT], capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["5"], proc.stdout


def test_decodes_keep_their_metadata_so_captured_graphs_read_their_buffers() -> None:
    """A decode-only step is already one query per row: its metadata comes back
    as it is (a CUDA graph replays over these very tensors). A step with a
    prompt chunk becomes one row per query token, each with its own context."""
    tables = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    decodes = AttentionMetadata(
        slot_mapping=torch.tensor([40, 81]),
        block_tables=tables,
        context_lens=torch.tensor([9, 18], dtype=torch.int32),
        cu_seqlens_q=torch.arange(3, dtype=torch.int32),
        num_decodes=2,
        context_lens_cpu=[9, 18],
        query_lens_cpu=[1, 1],
    )
    assert one_query_per_row(decodes) is decodes
    mixed = AttentionMetadata(
        slot_mapping=torch.tensor([40, 79, 80, 81]),
        block_tables=tables,
        context_lens=torch.tensor([9, 18], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 4], dtype=torch.int32),
        num_decodes=1,
        context_lens_cpu=[9, 18],
        query_lens_cpu=[1, 3],
    )
    rows = one_query_per_row(mixed)
    assert rows.context_lens_cpu == [9, 16, 17, 18] and rows.num_decodes == 4
    assert torch.equal(rows.block_tables, tables[[0, 1, 1, 1]])


TRITON_SCRIPT = textwrap.dedent(
    """
    import sys
    from tests.engine.conftest import random_prompts
    from tests.engine.invariance import compare, others, run

    path = sys.argv[1]
    target = random_prompts(1, seed=80, low=14, high=15)[0]
    shared = [(target[:8] + [5, 6], others(1, 81)[0][1])]
    kw = dict(target=target, attention_backend="triton", batch_invariant=True, block_size=4)
    same = compare({
        "alone": lambda: run(path, **kw),
        "chunked by 5, behind 2": lambda: run(
            path, before=others(2, 82), max_num_batched_tokens=5, **kw
        ),
        "prefix hit, ahead of 3": lambda: run(path, first=shared, after=others(3, 83), **kw),
    })
    assert all(same.values()), same
    print("bitwise equal:", len(same))
    """
)


@pytest.mark.triton
def test_triton_kernels_are_batch_invariant_under_the_interpreter(qwen3) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(qwen3[0])],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "bitwise equal: 3" in proc.stdout


def test_a_thousand_greedy_completions_in_random_company_agree(qwen3) -> None:
    """1,000 copies of one prompt, each among random other requests (no prefix
    cache, so each copy computes its own prompt): one distinct completion."""
    import random

    from engine import LLM, SamplingParams
    from tests.engine.conftest import random_prompts

    rng = random.Random(1000)
    target = random_prompts(1, seed=100, low=6, high=7)[0]
    fillers = random_prompts(50, seed=101, low=2, high=30)
    prompts, params = [], []
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for _ in range(1000):
        for _ in range(rng.randrange(3)):
            prompts.append(rng.choice(fillers))
            params.append(SamplingParams(temperature=0, max_tokens=rng.randint(1, 4)))
        prompts.append(target)
        params.append(greedy)
    llm = LLM(
        qwen3[0],
        dtype="float32",
        batch_invariant=True,
        enable_prefix_caching=False,
        max_num_seqs=48,
    )
    outs = llm.generate(prompts, params, use_tqdm=False)
    completions = {tuple(o.token_ids) for o, p in zip(outs, prompts) if p == target}
    assert len(completions) == 1


def test_seeded_samples_are_identical_alone_in_a_crowd_preempted_and_chunked(qwen3) -> None:
    """With the mode on, a seeded request's sampled tokens and their logprobs
    are exactly those it draws alone: in a crowd of seeded and unseeded
    requests, under preemption and recompute, and with its prompt chunked."""
    from engine import LLM, SamplingParams
    from tests.engine.conftest import random_prompts

    target = random_prompts(1, seed=110, low=40, high=41)[0]
    crowd = random_prompts(7, seed=111, low=3, high=50)
    mine = SamplingParams(
        temperature=1.0, top_p=0.9, seed=4321, max_tokens=16, logprobs=2, ignore_eos=True
    )
    theirs = [
        SamplingParams(temperature=0.7, seed=i, max_tokens=20, ignore_eos=True) for i in range(4)
    ] + [SamplingParams(temperature=1.0, max_tokens=20)] * 3

    results = {}
    for name, kwargs, company in [
        ("alone", {}, False),
        ("crowd", {}, True),
        ("preempted", dict(num_kv_blocks=10, block_size=8), True),
        ("chunked", dict(max_num_batched_tokens=7), True),
    ]:
        llm = LLM(qwen3[0], dtype="float32", batch_invariant=True, **kwargs)
        prompts = (crowd + [target]) if company else [target]
        params = (theirs + [mine]) if company else [mine]
        out = llm.generate(prompts, params, use_tqdm=False)[-1]
        results[name] = (out.token_ids, out.logprobs)
        if name == "preempted":
            assert llm.stats.preemptions > 0
    for name, got in results.items():
        assert got == results["alone"], name


def test_the_mode_picks_a_backend_that_keeps_it() -> None:
    """On the CPU the mode runs on the torch backend's split-KV path; the C++
    'cpu' backend, which attends prompt chunks by the batch, is refused."""
    from engine.config import EngineConfig

    assert (
        EngineConfig(str(TINY), dtype="float32", batch_invariant=True).attention_backend == "torch"
    )
    with pytest.raises(ValueError, match="batch_invariant=True needs attention_backend"):
        EngineConfig(str(TINY), dtype="float32", batch_invariant=True, attention_backend="cpu")
