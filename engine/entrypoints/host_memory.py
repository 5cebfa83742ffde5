"""Keeping a server's host memory flat: what grows in a long-running CPU
server's resident memory though no request holds it.

Measured with engine/tools/soak.py (issue 24, item 7), with tracemalloc flat
(the Python heap does not grow) and heaptrack naming the native allocations:

- **oneDNN's primitive caches.** Every packed linear layer (layers/linear.py)
  runs a oneDNN matmul primitive built for its exact shape, and a step's shape
  is its number of tokens, which differs from step to step. Each primitive
  built is cached, up to 1,024 of them in oneDNN's own cache and again in
  PyTorch's (ideep's) LRU cache, at about half a MiB each for a bf16 brgemm
  matmul: some 500 MiB for a server that sees every prompt length. What is
  worth keeping is the few shapes its decode steps repeat, so the server caps
  both caches. Each reads its capacity from the environment when it builds its
  first primitive, so the cap must be set before the model is loaded; a value
  the user set is kept.
- **glibc's free heap pages.** Activations of every size are allocated and
  freed each step, and the holes they leave inside the heap stay resident:
  glibc gives back only the top of the heap. malloc_trim(0) returns every
  whole free page (about 10 ms for this model's heap; some 50 MiB of a loaded
  server's), so the engine core calls it when it goes idle, at most once per
  interval. Under load the next steps would reuse those pages at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import time
from collections.abc import Callable

# Primitives each cache keeps: a step's linear layers need one per distinct
# weight shape (four for a dense model), so this holds the shapes of the last
# few dozen distinct batch sizes. Building a missed one costs under a millisecond.
ONEDNN_CACHE_CAPACITY = 128
ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
TRIM_INTERVAL_S = 5.0


def bound_onednn_caches(capacity: int = ONEDNN_CACHE_CAPACITY) -> None:
    """Cap oneDNN's primitive caches, unless the user's environment says otherwise.
    Only effective before this process builds its first oneDNN primitive."""
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(capacity))


def glibc_malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


class HeapTrimmer:
    """Gives the heap's free pages back to the system, at most once per interval."""

    def __init__(
        self,
        interval_s: float = TRIM_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self.malloc_trim = glibc_malloc_trim()
        self.last = clock()
        self.num_trims = 0

    def maybe_trim(self) -> bool:
        """Trim if the interval has passed since the last trim; True if it did."""
        now = self.clock()
        if self.malloc_trim is None or now - self.last < self.interval_s:
            return False
        self.malloc_trim(0)
        self.last = now
        self.num_trims += 1
        return True
