"""The sparse MLA decode kernel (DeepSeek-V3.2's DSA) against float64, in Triton's
interpreter: fresh random caches, chosen positions in random order, every cache
slot outside the chosen rows NaN (so a read of an unchosen row fails), output
and scratch buffers NaN (so an element left unwritten fails)."""

from __future__ import annotations

import random

import pytest
import torch

# First: sets TRITON_INTERPRET=1 and imports Triton afresh if it must.
from tests.kernels.test_kernels import TOLERANCE, check, poison, seed  # noqa: F401

# isort: split
from engine.kernels import sparse_mla_decode
from engine.kernels.decode_attention import KV_SPLIT_SIZE
from tests.engine.test_dsa import random_sparse_decode, sparse_mla_decode_reference

pytestmark = pytest.mark.triton


@pytest.mark.parametrize(
    ("rank", "rope", "num_heads", "block_size"),
    [(64, 16, 4, 16), (96, 8, 20, 4)],  # one head block; two, the second partial
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("k", [16, KV_SPLIT_SIZE + 40], ids=["one-split", "two-splits"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_sparse_mla_decode(
    dtype: torch.dtype,
    k: int,
    rank: int,
    rope: int,
    num_heads: int,
    block_size: int,
    seed: int,  # noqa: F811 (the fixture imported above)
    poison: None,  # noqa: F811
) -> None:
    # A context shorter than k (all of it chosen, -1 after), one of one token,
    # and one longer than k.
    contexts = [random.randint(2, k - 1), 1, k + random.randint(1, 100)]
    random.shuffle(contexts)
    q, cache, tables, chosen = random_sparse_decode(contexts, k, block_size, rank, rope, num_heads)
    q, cache = q.to(dtype), cache.to(dtype)
    scale = (rank + rope) ** -0.5
    out = torch.full((len(contexts), num_heads, rank), float("nan"), dtype=dtype)
    result = sparse_mla_decode(q, cache, tables, chosen, rank, scale, out=out)
    assert result is out
    ref = sparse_mla_decode_reference(q, cache, tables, chosen, rank, scale)
    check(out, ref, TOLERANCE[dtype], seed, f"contexts={contexts} k={k}")


def test_int32_positions_read_the_same_rows(seed: int) -> None:  # noqa: F811
    """Positions in int32, as a kernel caller may hold them, give the same output."""
    q, cache, tables, chosen = random_sparse_decode([30, 9], 12, 8, 32, 16, 4)
    wide = sparse_mla_decode(q, cache, tables, chosen, 32, 0.2)
    narrow = sparse_mla_decode(q, cache, tables, chosen.int(), 32, 0.2)
    assert torch.equal(wide, narrow), seed
