"""Run the book's snippets in one fixed environment, to check or rewrite their records.

    python snippets/_runner.py check [PATH ...]   diff each snippet's stdout with its .out
    python snippets/_runner.py regen [PATH ...]   rewrite .out files, plots and the edition manifest

Experiments are snippets/chNN/eNN_slug.py and engine demos snippets/chNN/demo_slug.py.
Each one's recorded stdout sits beside it as .out. `make regen` is the only target
that calls `regen`; the tests call `run` and compare.
"""

from __future__ import annotations

import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SNIPPET = re.compile(r"^snippets/ch\d\d/(e\d\d_\w+|demo_\w+)\.py$")
EXPERIMENT = re.compile(r"^snippets/ch(?P<chapter>\d\d)/e(?P<number>\d\d)_\w+\.py$")
PLOTS = ROOT / "snippets" / "plots"
PLOT_DIR = ROOT / "docs" / "assets" / "plots"
TIMEOUT_S = 900


def discover() -> list[str]:
    """Every experiment and demo, as repo-relative paths, sorted."""
    found = (p.relative_to(ROOT).as_posix() for p in ROOT.glob("snippets/ch*/*.py"))
    return sorted(p for p in found if SNIPPET.match(p))


def fixed_env() -> dict[str, str]:
    """The one environment every snippet runs in: seeded hashing, UTC, one thread, CPU."""
    keep = ("PATH", "HOME", "TMPDIR", "VIRTUAL_ENV", "SYSTEMROOT")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        PYTHONHASHSEED="0",
        TZ="UTC",
        LC_ALL="C.UTF-8",
        PYTHONIOENCODING="utf-8",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",  # one torch (intra-op) thread
        MKL_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",  # CPU, even on a machine with a GPU
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


def run(path: str) -> str:
    """A snippet's stdout; a failing snippet raises with its stderr."""
    proc = subprocess.run(
        [sys.executable, path],
        cwd=ROOT,
        env=fixed_env(),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{path} exited with {proc.returncode}:\n{proc.stderr}")
    return proc.stdout


def record_path(path: str) -> Path:
    return ROOT / Path(path).with_suffix(".out")


def diff(path: str, recorded: str, actual: str) -> str:
    lines = difflib.unified_diff(
        recorded.splitlines(keepends=True),
        actual.splitlines(keepends=True),
        fromfile=f"{Path(path).with_suffix('.out')} (recorded)",
        tofile=f"{path} (stdout now)",
    )
    return "".join(lines)


def regen_hint(path: str) -> str:
    return f"If the new output is right, record it with: python snippets/_runner.py regen {path}  (or: make regen)"


def plot_scripts() -> list[Path]:
    scripts = PLOTS.glob("*.py") if PLOTS.is_dir() else []
    return sorted(p for p in scripts if not p.name.startswith("_"))  # _plotting.py is shared


def render_plot(script: Path, out: Path) -> None:
    """Each plot script writes one deterministic SVG to the path it is given."""
    subprocess.run([sys.executable, str(script), str(out)], cwd=ROOT, env=fixed_env(), check=True)


def plot_target(script: Path) -> Path:
    return PLOT_DIR / f"{script.stem}.svg"


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("check", "regen"):
        print(__doc__)
        return 2
    verb, paths = argv[0], argv[1:] or discover()
    failed = 0
    for path in paths:
        actual = run(path)
        target = record_path(path)
        if verb == "regen":
            target.write_text(actual)
            print(f"recorded {target.relative_to(ROOT)}")
            continue
        recorded = target.read_text() if target.exists() else ""
        if recorded != actual:
            failed += 1
            print(diff(path, recorded, actual) + regen_hint(path))
    if verb == "regen" and not argv[1:]:
        PLOT_DIR.mkdir(parents=True, exist_ok=True)
        for script in plot_scripts():
            render_plot(script, plot_target(script))
            print(f"plotted {plot_target(script).relative_to(ROOT)}")
        sys.path.insert(0, str(ROOT))
        from engine.tools.edition import write_manifest

        print(f"wrote {write_manifest(ROOT).relative_to(ROOT)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
