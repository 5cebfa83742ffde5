"""Attention against exact float64 softmax attention, where two online-softmax
merges can go wrong without the engine's self-consistency checks noticing.

* The batch-invariant torch backend (engine/attention/torch_split_kv.py) folds
  splits of KV_SPLIT keys into a running max, denominator and output. Its tests
  compare the mode with itself (bits in any company), so a merge that forgets to
  rescale a split's denominator to the new running max would pass them all.
  Here its decodes and prompt chunks meet a float64 reference, on scores spread
  wide enough that the running max moves up and down from split to split.
* The C++ decode operator (engine/csrc/paged_attention.cpp) starts its running
  max at "no score". Started at 0 instead, it gives the same answer (up to
  rounding) for every input whose best score is above about -87, and NaN (or
  noise) for one whose scores all lie far below zero, where exp(score - 0)
  underflows: those inputs are checked here.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import csrc
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_split_kv import KV_SPLIT, TorchSplitKVBackend
from engine.kv.kv_cache import PagedKV

# float32 attention over O(1..10) scores, against float64: its rounding is ~1e-6.
SPLIT_KV_TOLERANCE = 2e-5  # max |engine - exact| / max |exact|
# Scores near -150 carry float32 rounding of ~1e-5 each, which moves the weights by
# about as much (measured: at most 4e-6); bf16 adds its output rounding (4e-3).
# A running max started at 0 gives NaN.
FAR_BELOW_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def exact_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float
) -> torch.Tensor:
    """Softmax attention in float64 for one query token: q [heads, dim] over
    keys and values [n, kv_heads, dim]; GQA groups share a KV head."""
    heads, kv_heads = q.shape[0], keys.shape[1]
    k = keys.double().repeat_interleave(heads // kv_heads, dim=1)
    v = values.double().repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("hd,nhd->hn", q.double(), k) * scale
    return torch.einsum("hn,nhd->hd", scores.softmax(-1), v)


def paged_cache(
    lens: list[int], kv_heads: int, dim: int, block_size: int, gen: torch.Generator, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An empty paged cache and a block table per sequence, the blocks shuffled
    over the whole cache so that a sequence's blocks are not adjacent."""
    need = [math.ceil(n / block_size) for n in lens]
    num_blocks = sum(need) + 3  # some blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need)
    tables = torch.full((len(lens), width), -1, dtype=torch.int32)
    at = 0
    for i, b in enumerate(need):
        tables[i, :b] = torch.tensor(order[at : at + b], dtype=torch.int32)
        at += b
    k = torch.zeros(num_blocks, block_size, kv_heads, dim, dtype=dtype)
    return k, torch.zeros_like(k), tables


def write(cache: torch.Tensor, table: torch.Tensor, rows: torch.Tensor) -> None:
    """Put a sequence's rows [n, kv_heads, dim] at its positions 0..n-1."""
    bs = cache.shape[1]
    for p, row in enumerate(rows):
        cache[table[p // bs], p % bs] = row


# --- The batch-invariant split-KV merge ------------------------------------


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    seqs=st.lists(
        st.tuples(st.integers(1, 5 * KV_SPLIT + 7), st.integers(1, 4)), min_size=1, max_size=4
    ),
    block_size=st.sampled_from([4, 16, 32]),
    heads=st.sampled_from([(4, 4), (4, 2), (4, 1)]),
    spread=st.sampled_from([2.0, 6.0]),
    seed=st.integers(0, 2**16),
)
def test_split_kv_attention_is_exact_softmax_attention(
    seqs: list[tuple[int, int]],
    block_size: int,
    heads: tuple[int, int],
    spread: float,
    seed: int,
) -> None:
    """Batch-invariant attention (decodes and prompt chunks) equals float64
    softmax attention over each query's keys 0..p. Guards the split merge: a
    split's denominator added without rescaling it to the new running max
    (or the old one not rescaled) gives weights that no longer sum to one."""
    num_heads, kv_heads = heads
    dim = 16
    gen = torch.Generator().manual_seed(seed)
    # (context length, query tokens this step), decodes first as the runner orders them
    seqs = sorted(((max(n, q), min(q, max(n, q))) for n, q in seqs), key=lambda s: s[1] != 1)
    lens = [n for n, _ in seqs]
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, dim, block_size, gen, torch.float32)
    keys, values = [], []
    for i, n in enumerate(lens):
        # Keys whose size changes from position to position: the best score of a
        # split is sometimes above, sometimes below the running max so far.
        size = 1 + spread * torch.rand(n, 1, 1, generator=gen)
        keys.append(torch.randn(n, kv_heads, dim, generator=gen) * size)
        values.append(torch.randn(n, kv_heads, dim, generator=gen))
        write(k_cache, tables[i], keys[i])
        write(v_cache, tables[i], values[i])
    query_lens = [q for _, q in seqs]
    q = torch.randn(sum(query_lens), num_heads, dim, generator=gen)
    cu = [0]
    for n in query_lens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),  # forward does not write
        block_tables=tables,
        context_lens=torch.tensor(lens, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        num_decodes=sum(1 for n in query_lens if n == 1),
        context_lens_cpu=lens,
        query_lens_cpu=query_lens,
    )
    backend = TorchSplitKVBackend(block_size)
    scale = dim**-0.5
    cache = PagedKV(k_cache, v_cache)
    out = backend.forward(q, None, None, cache, backend.build_metadata(meta), scale)
    assert out.shape == q.shape
    expect = torch.empty(q.shape, dtype=torch.float64)
    for i, (n, m) in enumerate(seqs):
        for j in range(m):  # query j of the chunk sits at position n - m + j
            upto = n - m + j + 1
            expect[cu[i] + j] = exact_attention(
                q[cu[i] + j], keys[i][:upto], values[i][:upto], scale
            )
    err = ((out.double() - expect).abs().max() / expect.abs().max()).item()
    assert err < SPLIT_KV_TOLERANCE, (err, seqs)


def test_split_kv_merge_with_the_best_key_in_the_first_split() -> None:
    """One decode over three splits whose first holds by far the best key: every
    later split's max is below the running max, so its sum of exponentials must be
    scaled down by exp(m_split - m_running) before it is added."""
    dim, block_size = 8, 16
    n = 3 * KV_SPLIT
    gen = torch.Generator().manual_seed(1)
    k_cache, v_cache, tables = paged_cache([n], 1, dim, block_size, gen, torch.float32)
    q = torch.randn(1, 1, dim, generator=gen)
    keys = torch.randn(n, 1, dim, generator=gen) * 0.5
    keys[5, 0] = 3.0 * q[0, 0]  # the score of key 5 is far above every other
    values = torch.randn(n, 1, dim, generator=gen)
    write(k_cache, tables[0], keys)
    write(v_cache, tables[0], values)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(1, dtype=torch.int64),
        block_tables=tables,
        context_lens=torch.tensor([n], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        num_decodes=1,
        context_lens_cpu=[n],
        query_lens_cpu=[1],
    )
    backend = TorchSplitKVBackend(block_size)
    scale = dim**-0.5
    out = backend.forward(
        q, None, None, PagedKV(k_cache, v_cache), backend.build_metadata(meta), scale
    )
    expect = exact_attention(q[0], keys, values, scale)
    err = ((out[0].double() - expect).abs().max() / expect.abs().max()).item()
    assert err < SPLIT_KV_TOLERANCE, err


# --- The C++ decode operator, on scores far below zero ---------------------


def far_below_zero_inputs(
    lens: list[int], heads: int, kv_heads: int, dim: int, block_size: int, dtype, seed: int
):
    """q and K chosen so that every score q.k * scale lies in [-200, -100]: each
    key is -t * u (plus noise orthogonal to u) for a unit vector u of its KV head,
    and each query head c * u, so q.k * scale = -c * t / scale * scale = -c * t."""
    gen = torch.Generator().manual_seed(seed)
    scale = dim**-0.5
    k_cache, v_cache, tables = paged_cache(lens, kv_heads, dim, block_size, gen, dtype)
    u = torch.randn(kv_heads, dim, generator=gen, dtype=torch.float64)
    u /= u.norm(dim=-1, keepdim=True)
    group = heads // kv_heads
    # Query heads c * u * a, keys -(t / (scale * a)) * u: |q| and |k| both near 35.
    a = 36.0
    c = 1.0 + 0.25 * torch.rand(len(lens), kv_heads, group, generator=gen, dtype=torch.float64)
    q = (c[..., None] * a * u[None, :, None, :]).reshape(len(lens), heads, dim)
    keys, values = [], []
    for i, n in enumerate(lens):
        t = 100.0 + 60.0 * torch.rand(n, kv_heads, 1, generator=gen, dtype=torch.float64)
        noise = torch.randn(n, kv_heads, dim, generator=gen, dtype=torch.float64)
        noise -= (noise * u).sum(-1, keepdim=True) * u  # orthogonal to u: no score change
        k = -(t / (scale * a)) * u + noise
        keys.append(k.to(dtype))
        values.append(torch.randn(n, kv_heads, dim, generator=gen).to(dtype))
        write(k_cache, tables[i], keys[i])
        write(v_cache, tables[i], values[i])
    q = q.to(dtype)
    return q, k_cache, v_cache, tables, keys, values, scale


needs_csrc = pytest.mark.skipif(not csrc.load(), reason="no C++ compiler to build engine/csrc")


@needs_csrc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16])
# 64 and 128 run the unrolled copies of the kernel, 32 the general one.
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(4, 2, 64), (2, 1, 128), (4, 4, 32)])
def test_cpu_decode_op_on_scores_far_below_zero(
    dtype, block_size: int, heads: int, kv_heads: int, dim: int
) -> None:
    """Every score in [-200, -100]: the operator still returns the exact softmax
    average of the values. Guards its running max, which must start at "no score":
    started at 0, every exp(score - max) underflows and the result is 0 / 0."""
    lens = [1, 7, 40]
    q, k, v, tables, keys, values, scale = far_below_zero_inputs(
        lens, heads, kv_heads, dim, block_size, dtype, seed=heads * dim + block_size
    )
    for i in range(len(lens)):  # the premise holds: every score far below zero
        k_i = keys[i].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), k_i) * scale
        assert scores.min() > -205 and scores.max() < -98, (scores.min(), scores.max())
    ctx = torch.tensor(lens, dtype=torch.int32)
    out = torch.ops.deepinfer.paged_decode_attention(q, k, v, tables, ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    bad = int((~torch.isfinite(out)).sum())
    assert bad == 0, f"{bad} of {out.numel()} outputs NaN or inf on scores far below zero"
    for i in range(len(lens)):
        expect = exact_attention(q[i], keys[i], values[i], scale)
        err = ((out[i].double() - expect).abs().max() / expect.abs().max()).item()
        assert err < FAR_BELOW_TOLERANCE[dtype], (i, err)
