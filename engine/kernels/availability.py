"""Can the Triton kernels run here? Answered without importing Triton's kernels.

On a CUDA device the kernels are compiled. On the CPU they run only in
Triton's interpreter, which `triton.jit` selects when a function is
*decorated*, that is when its module is first imported (it asks
triton.knobs.runtime.interpret, which reads TRITON_INTERPRET, at that moment).
Triton's own library is decorated when `triton` is imported, so the variable
must be in the environment before that; setting it later changes nothing for
functions that already exist.
"""

from __future__ import annotations

import os
import sys

import torch


def interpreter_active() -> bool:
    """True when Triton kernels run in the interpreter (TRITON_INTERPRET=1), on the CPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def compiled_kernel_modules() -> list[str]:
    """Modules whose `@triton.jit` functions were built for the compiler, not the interpreter.

    That includes Triton's own library: tl.sum, tl.max and tl.cdiv are jitted
    functions, built when `triton` is imported. So TRITON_INTERPRET=1 must be
    set before Triton is imported, not just before `engine.kernels`; a process
    that sets it later must drop Triton's Python modules and these from
    `sys.modules` and import them again.
    """
    if "triton" not in sys.modules:
        return []
    from triton.runtime.jit import JITFunction  # the interpreter's functions are not JITFunctions

    return sorted(
        name
        for name, module in list(sys.modules.items())
        if name.startswith(("triton.language.", "engine.kernels."))
        and module is not None
        and any(isinstance(value, JITFunction) for value in vars(module).values())
    )


def check_available(device: torch.device | str) -> None:
    """Raise a RuntimeError that says what to do when the kernels cannot run on `device`."""
    device = torch.device(device)
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            'Triton is not installed, so the Triton kernels cannot run; use attention_backend="torch"'
        ) from exc
    if device.type == "cuda":
        return
    if device.type != "cpu":
        raise RuntimeError(
            f"the Triton kernels run on CUDA, or on the CPU under TRITON_INTERPRET=1, not on "
            f'{device.type}; use attention_backend="torch"'
        )
    if not interpreter_active():
        raise RuntimeError(
            "the Triton kernels run on the CPU only in Triton's interpreter: set TRITON_INTERPRET=1 "
            'in the environment before starting Python, or use attention_backend="torch"'
        )
    if stale := compiled_kernel_modules():
        raise RuntimeError(
            f"{', '.join(stale)} were imported before TRITON_INTERPRET=1 was set, so their kernels "
            "were built for the GPU compiler; set TRITON_INTERPRET=1 before importing triton"
        )


def available(device: torch.device | str) -> bool:
    """Whether the Triton kernels can run on `device`: check_available, without its error."""
    try:
        check_available(device)
    except RuntimeError:
        return False
    return True
