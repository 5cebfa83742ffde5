"""Small helpers the engine's modules share."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the block manager's hash reaches the router, which loads no torch
    import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host data on ``device``. On a GPU the copy goes through pinned
    memory and does not wait: the host can go on preparing while it runs."""
    import torch

    t = torch.tensor(data, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t
