"""The layers a compiled forward pass calls as opaque operators.

Under torch.compile (engine/runner/compiled_decode.py) some layers stay out of
the graph. Attention reads and writes the paged cache, which the compiler must
neither copy nor see through its per-layer views. A MoE layer's experts size
their matmuls from the routing, on the host. Each such layer calls a custom
operator that names it by its ``index`` among the modules of the forward pass
now running. An index, not the module, goes into the graph: the same in every
process, so the compiled code cached on disk by one run serves the next.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from torch import nn

_running: Sequence[nn.Module] = ()  # the opaque layers of the compiled pass now running


@contextmanager
def running(modules: Sequence[nn.Module]) -> Iterator[None]:
    """Let the operators find the running model's opaque layers by index."""
    global _running
    _running = modules
    try:
        yield
    finally:
        _running = ()


def layer(index: int) -> nn.Module:
    """The running model's opaque layer with this index."""
    return _running[index]
