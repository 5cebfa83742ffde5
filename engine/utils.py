"""Small helpers the engine's modules share."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the block manager's hash reaches the router, which loads no torch
    import numpy as np
    import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of host data on ``device``. The list becomes a numpy array first,
    since numpy reads a list of Python numbers faster than torch.tensor does (a
    nested one several times faster), and every step builds several such tensors.
    On a GPU the copy goes through pinned memory and does not wait: the host
    can go on preparing while it runs."""
    import numpy as np
    import torch

    t = torch.from_numpy(np.array(data, dtype=_numpy_dtype(dtype)))
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


@cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """numpy's name for one of torch's dtypes: int64, int32, float32, bool."""
    import numpy as np

    return np.dtype(str(dtype).removeprefix("torch."))
