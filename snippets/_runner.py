"""Run the book's snippets in one fixed environment, to check or rewrite their records.

    python snippets/_runner.py check [PATH ...]      diff each snippet's stdout and results with its records
    python snippets/_runner.py regen [PATH ...]      rewrite the records, plots and the edition manifest
    python snippets/_runner.py perturbed [PATH ...]  check the engine's snippets on other float kernels

Experiments are snippets/chNN/eNN_slug.py and engine demos snippets/chNN/demo_slug.py.
Each defines main(), which prints what the book shows and returns the named
values the prose quotes (a dict, or None). Its recorded stdout sits beside it
as .out, and its results as .json. `make regen` is the only target that calls
`regen`; the tests call `run` and compare.

A demo may measure what no record can hold, such as the engine's step timeline,
whose times differ on every run. Under `regen` alone the runner sets
SNIPPETS_RECORD=1, and such a demo then saves its measurements for a plot
(snippets/plots/data/); `check` runs it without, so nothing drifts but the
plot, which make regen redraws from the data it saved.

What a record may hold
----------------------
A record holds only what every correct machine prints, whatever its CPU, its
math library or its thread count: token ids and text, counts decided by
integer logic, exact invariants ("24 of 24 bitwise equal", "1 distinct"), and
floats that the snippet rounds to a precision it states where the engine's
float arithmetic feeds them. A demo's float results must survive rounding to
six significant digits (check_results refuses them otherwise), so a raw
float32 difference cannot slip into a .json.

A demo whose point is a machine-dependent number prints it on a line that
begins with VARIES ("~"). The .out keeps the line as the recording machine
printed it, so the page can show an example, but the check compares only that
such a line stands there, not what it says; such a number is never a result.

    python snippets/_runner.py perturbed [PATH ...]

runs the engine's snippets (those that import torch or the engine) under each
environment in PERTURBATIONS, which change the float kernels a machine would
choose (other oneDNN, MKL and ATen vector ISAs, the portable C++ build, two
threads), and requires the same records. tests/test_machine_independence.py
runs it in `make test`.
"""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import subprocess
import sys
import tempfile
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


# Lines that begin with this hold a machine-dependent value: checked for place, not content.
VARIES = "~"
# Environments that make torch, oneDNN, MKL and the C++ op pick other float kernels,
# as another CPU would. Each is laid over fixed_env() on purpose; nothing else leaks in.
# Two of them, so that on any x86 machine at least two kernel families meet the
# records, whichever one the machine itself runs in the fixed environment.
PERTURBATIONS: dict[str, dict[str, str]] = {
    "avx2-2-threads": {
        "DNNL_MAX_CPU_ISA": "AVX2",  # oneDNN: packed linears and mkldnn matmuls
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",  # MKL's float32 and float64 GEMMs
        "ATEN_CPU_CAPABILITY": "avx2",  # ATen's own vectorized kernels
        "OMP_NUM_THREADS": "2",  # reductions split over two threads
        "MKL_NUM_THREADS": "2",
    },
    "sse41-portable": {
        "DNNL_MAX_CPU_ISA": "SSE41",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
        "ATEN_CPU_CAPABILITY": "default",  # unvectorized
        "DEEPINFER_PORTABLE_BUILD": "1",  # the C++ decode op without -march=native
    },
}


def fixed_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """The one environment every snippet runs in: seeded hashing, UTC, one thread, CPU;
    ``overrides`` (one of PERTURBATIONS) are laid over it."""
    keep = ("PATH", "HOME", "TMPDIR", "VIRTUAL_ENV", "SYSTEMROOT", "TORCH_EXTENSIONS_DIR", "CXX")
    env = {k: os.environ[k] for k in keep if k in os.environ}
    env.update(
        PYTHONHASHSEED="0",
        TZ="UTC",
        LC_ALL="C.UTF-8",
        PYTHONIOENCODING="utf-8",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",  # one torch (intra-op) thread
        MKL_NUM_THREADS="1",
        # Idle OpenMP threads sleep rather than spin: under a perturbation's two
        # threads on a busy two-core machine, spinning ones stall each other (a
        # snippet took ten times as long). The policy changes no number.
        OMP_WAIT_POLICY="PASSIVE",
        CUDA_VISIBLE_DEVICES="",  # CPU, even on a machine with a GPU
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.update(overrides or {})
    return env


def comparable(text: str) -> str:
    """A record as the check compares it: each VARIES line reduced to its marker."""
    return "".join(
        VARIES + "\n" if line.startswith(VARIES) else line for line in text.splitlines(True)
    )


def matches(recorded: str, actual: str) -> bool:
    return comparable(recorded) == comparable(actual)


# Runs a snippet's main() as `python snippet.py` would, and keeps what it returns.
BOOTSTRAP = """
import json, runpy, sys
path, sink = sys.argv[1], sys.argv[2]
sys.argv = [path]
main = runpy.run_path(path, run_name="__snippet__").get("main")
results = main() if main else None
sys.stdout.flush()
with open(sink, "w") as f:
    json.dump(results, f)
"""
NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def check_results(path: str, results: object) -> dict:
    """Results are a dict of lowercase names to numbers, strings, booleans, or
    lists of those; anything else could not be written into prose faithfully.
    A demo's floats come from the engine's arithmetic, so they must be rounded
    (see "What a record may hold")."""
    if results is None:
        return {}
    if not isinstance(results, dict):
        raise TypeError(f"{path}: main() must return a dict of named results or None")
    for name, value in results.items():
        items = value if isinstance(value, list) else [value]
        if not NAME.match(name):
            raise ValueError(f"{path}: result name {name!r} is not lowercase_with_underscores")
        if not all(isinstance(v, bool | int | float | str) for v in items):
            raise TypeError(f"{path}: result {name!r} = {value!r} is not a number or string")
        if any(isinstance(v, float) and not math.isfinite(v) for v in items):
            raise ValueError(f"{path}: result {name!r} = {value!r} is not finite")
        if is_demo(path) and any(isinstance(v, float) and v != rounded(v) for v in items):
            raise ValueError(
                f"{path}: result {name!r} = {value!r} carries the machine's last bits; round it"
                " to the precision the demo states, or print it on a VARIES line instead"
            )
    return results


def is_demo(path: str) -> bool:
    return Path(path).name.startswith("demo_")


def rounded(value: float) -> float:
    return float(f"{value:.6g}")


def imported_modules(path: str) -> set[str]:
    """The top-level packages a snippet imports (absolute imports only)."""
    import ast

    tree = ast.parse((ROOT / path).read_text(), filename=path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def engine_snippets() -> list[str]:
    """The snippets whose output passes through torch's or the engine's float kernels."""
    return [p for p in discover() if imported_modules(p) & {"engine", "torch"}]


def run(
    path: str,
    python: str = sys.executable,
    record: bool = False,
    overrides: dict[str, str] | None = None,
) -> tuple[str, dict]:
    """A snippet's stdout and its results; a failing snippet raises with its stderr.
    With ``record``, a demo also saves the measurements its plot draws; ``overrides``
    run it under one of PERTURBATIONS."""
    env = fixed_env(overrides)
    if record:
        env["SNIPPETS_RECORD"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        sink = Path(tmp) / "results.json"
        proc = subprocess.run(
            [python, "-c", BOOTSTRAP, path, str(sink)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{path} exited with {proc.returncode}:\n{proc.stderr}")
        return proc.stdout, check_results(path, json.loads(sink.read_text()))


def record_path(path: str) -> Path:
    return ROOT / Path(path).with_suffix(".out")


def results_path(path: str) -> Path:
    return ROOT / Path(path).with_suffix(".json")


def results_text(results: dict) -> str:
    """The sidecar's exact text: one value a line, sorted, so its diffs read well."""
    return json.dumps(results, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def recorded_results(path: str) -> dict:
    target = results_path(path)
    return json.loads(target.read_text()) if target.exists() else {}


def snippet_key(path: str) -> str:
    """snippets/ch02/demo_x.py -> ch02/demo_x, the name pages use."""
    return Path(path).relative_to("snippets").with_suffix("").as_posix()


def results_diff(path: str, recorded: dict, actual: dict) -> str:
    """Each value that changed, with every place in the book that shows it."""
    sys.path.insert(0, str(ROOT))
    from engine.tools.results import all_bindings

    shown: dict[str, list[str]] = {}
    for b in all_bindings(ROOT):
        if b.kind == "result" and b.source == snippet_key(path):
            shown.setdefault(b.name, []).append(b.where)
    lines = []
    for name in sorted(set(recorded) | set(actual)):
        was, now = recorded.get(name, "(absent)"), actual.get(name, "(absent)")
        if was != now or type(was) is not type(now):
            where = ", ".join(shown.get(name, [])) or "no page"
            lines.append(
                f"  {snippet_key(path)}.{name}: recorded {was!r}, now {now!r}; shown on {where}"
            )
    if not lines:
        return ""
    return f"{results_path(path).relative_to(ROOT)}: results changed\n" + "\n".join(lines) + "\n"


def write_results(path: str, results: dict) -> None:
    target = results_path(path)
    if results:
        target.write_text(results_text(results))
    elif target.exists():
        target.unlink()


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


def check_one(path: str, overrides: dict[str, str] | None = None) -> str:
    """What differs between a snippet's records and a run of it now; empty when nothing."""
    actual, results = run(path, overrides=overrides)
    target = record_path(path)
    recorded = target.read_text() if target.exists() else ""
    changed = results_diff(path, recorded_results(path), results)
    if matches(recorded, actual) and not changed:
        return ""
    return diff(path, recorded, actual) + changed


def regen_one(path: str) -> None:
    actual, results = run(path, record=True)
    changed = results_diff(path, recorded_results(path), results)
    record_path(path).write_text(actual)
    write_results(path, results)
    print(f"recorded {record_path(path).relative_to(ROOT)}")
    if changed:  # the prose around these values was written for the old ones
        print(changed + "  reread the prose at each place shown")


def regen_rest() -> None:
    """After a whole regen: every plot, and the edition manifest."""
    PLOT_DIR.mkdir(parents=True, exist_ok=True)
    for script in plot_scripts():
        render_plot(script, plot_target(script))
        print(f"plotted {plot_target(script).relative_to(ROOT)}")
    sys.path.insert(0, str(ROOT))
    from engine.tools.edition import write_manifest

    print(f"wrote {write_manifest(ROOT).relative_to(ROOT)}")


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("check", "regen", "perturbed"):
        print(__doc__)
        return 2
    verb, paths = argv[0], argv[1:]
    if verb == "regen":
        for path in paths or discover():
            regen_one(path)
        if not paths:
            regen_rest()
        return 0
    failed = 0
    envs = PERTURBATIONS if verb == "perturbed" else {"fixed": {}}
    for path in paths or (engine_snippets() if verb == "perturbed" else discover()):
        for name, overrides in envs.items():
            if problem := check_one(path, overrides):
                failed += 1
                print(f"[{name}] {problem}{regen_hint(path)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
