"""Batch-invariant mode: a request's logits do not depend on what else is in the batch.

Floating-point addition is not associative, so the bits of a sum depend on the
order of its terms. A kernel that chooses its order from the batch's shape (a
matrix product that switches algorithm with the number of rows, attention over
a batch padded to its longest member) gives one request different bits in
different company, and a near-tie between two tokens can then go either way.

With ``LLM(..., batch_invariant=True)`` every reduction a row goes through has
an order fixed by that row alone:

* matrix products run on tiles of ``ROW_TILE`` rows, one product per tile, every
  one of the same shape, so each row meets the same kernel whatever the batch
  size and the thread count (`linear`);
* RMSNorm and the sampler's softmaxes reduce along each row, as they always do;
* attention treats every query token as a row of its own (`one_query_per_row`, in attention/metadata.py)
  and reads its keys in splits of a fixed size, the same for a prompt chunk and
  a decode, so a token's attention does not depend on how its prompt was cut
  into chunks or found in the prefix cache.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from engine.utils import cdiv

ROW_TILE = 16  # rows per matrix-product call in batch-invariant mode


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None):
    """x @ weight.T + bias, one product of ROW_TILE rows at a time, the last one padded.

    Every product has the same shape, so the library makes the same choices for
    each (its algorithm, and how it shares the work among threads), and each row's
    sums run in the same order whichever tile it lands in and wherever in the
    tile. One product of all the rows is free to choose from the number of rows,
    and so is one batched product of all the tiles: MKL's AVX2 code (what it runs
    on AMD CPUs) on two threads gives a row other bits once there are two tiles.
    """
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    rows = F.pad(rows, (0, 0, 0, cdiv(n, ROW_TILE) * ROW_TILE - n))
    out = torch.cat([tile @ weight.T for tile in rows.split(ROW_TILE)])[:n]
    if bias is not None:
        out = out + bias
    return out.view(*x.shape[:-1], weight.shape[0])


def use_fixed_row_tiles(model: nn.Module) -> None:
    """From now on every ``nn.Linear`` in ``model`` computes through `linear`."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.forward = partial(_tiled_forward, module)


def _tiled_forward(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return linear(x, module.weight, module.bias)
