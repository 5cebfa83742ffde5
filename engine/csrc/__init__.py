"""The engine's C++ operators for the CPU, built on first use.

torch.utils.cpp_extension compiles engine/csrc/*.cpp with the machine's C++
compiler and caches the library (under TORCH_EXTENSIONS_DIR, by default
~/.cache/torch_extensions), so only the first process on a machine waits for
the build. The operators register themselves with torch as ``torch.ops.deepinfer.*``.

``-march=native`` lets the compiler use the vector units of the CPU it runs
on; set DEEPINFER_PORTABLE_BUILD=1 for a library that runs on any x86-64 or
arm64 machine. Without a compiler, or when the build fails, ``load()`` says why
once and returns False, and the engine keeps to its torch path.

torch guards a build with a lock file that only a finished build removes, so a
build killed halfway (Ctrl-C during the first run) would leave every later
process waiting on it forever. Builders of one library here take turns under an
operating-system lock instead, which dies with its holder; under it, a lock file
left behind is stale, and goes (build_lock).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_attention.cpp",
        "fp8_linear.cpp",
        "fp4_linear.cpp",
        "int8_linear.cpp",
        "int4_linear.cpp",
        "bf16_linear.cpp",
    )
]


def portable() -> bool:
    return os.environ.get("DEEPINFER_PORTABLE_BUILD") == "1"


HEADERS = sorted(Path(__file__).parent.glob("*.h"))


def build_flags() -> list[str]:
    # -fopenmp: at::parallel_for is inline, and spreads the work over torch's
    # threads only when the extension itself is compiled with OpenMP.
    flags = ["-O3", "-fopenmp", "-ffast-math", *([] if portable() else ["-march=native"])]
    return [*flags, f"-DDEEPINFER_HEADERS={headers_digest()}"]


def headers_digest() -> str:
    """torch rebuilds when a source or a flag changes, and reads no header: this
    flag carries the headers' contents into that check."""
    digest = hashlib.sha256(b"".join(h.read_bytes() for h in HEADERS))
    return digest.hexdigest()[:16]


def library_name() -> str:
    """One cached library per checkout: two checkouts sharing one name would each
    find the other's build in the cache and rebuild it, every time they alternate."""
    here = hashlib.sha256(str(SOURCES[0].parent.resolve()).encode()).hexdigest()[:8]
    return f"deepinfer_cpu{'_portable' if portable() else ''}_{here}"


@contextmanager
def build_lock(name: str) -> Iterator[Path]:
    """Hold the library's build folder alone, with torch's own lock file in it
    removed: any still there was left by a build killed before it finished, since
    every builder holds this lock while it builds. Yields the folder."""
    from torch.utils import cpp_extension

    folder = Path(cpp_extension._get_build_directory(name, verbose=False))
    with open(folder.parent / f"{name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released when this process ends, however
        (folder / "lock").unlink(missing_ok=True)
        yield folder


@functools.cache
def load() -> bool:
    """Build (or find in the cache) and load the operators; True when they are usable."""
    try:
        from torch.utils import cpp_extension

        with build_lock(library_name()):
            cpp_extension.load(
                name=library_name(),
                sources=[str(s) for s in SOURCES],
                extra_cflags=build_flags(),
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as e:  # no compiler, a failed build: the torch path still works
        lines = str(e).strip().splitlines() or [type(e).__name__]
        reason = next((ln for ln in lines if "error:" in ln), lines[0])[:300].strip()
        warnings.warn(
            f"DeepInfer: the C++ CPU operators could not be built ({reason}); "
            'using the torch attention path (attention_backend="torch")',
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True
