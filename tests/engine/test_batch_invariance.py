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

from engine.batch_invariant import ROW_TILE, linear
from tests.conftest import ROOT
from tests.engine.invariance import compare, scenarios

TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"


def test_logits_are_bitwise_equal_in_any_company() -> None:
    same = compare(scenarios(TINY, batch_invariant=True))
    assert all(same.values()), same


def test_without_the_mode_company_changes_the_bits() -> None:
    """The control: the same scenarios, mode off, do change the target's logits."""
    chosen = ("alone", "behind 3", "chunked by 16")
    same = compare({k: v for k, v in scenarios(TINY).items() if k in chosen})
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
