"""Run the book's snippets in one fixed environment, to check or rewrite their records.

    python snippets/_runner.py check [PATH ...]   diff each snippet's stdout and results with its records
    python snippets/_runner.py regen [PATH ...]   rewrite the records, plots and the edition manifest

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


def fixed_env() -> dict[str, str]:
    """The one environment every snippet runs in: seeded hashing, UTC, one thread, CPU."""
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
        CUDA_VISIBLE_DEVICES="",  # CPU, even on a machine with a GPU
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    return env


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
    lists of those; anything else could not be written into prose faithfully."""
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
    return results


def run(path: str, python: str = sys.executable, record: bool = False) -> tuple[str, dict]:
    """A snippet's stdout and its results; a failing snippet raises with its stderr.
    With ``record``, a demo also saves the measurements its plot draws."""
    env = fixed_env()
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


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("check", "regen"):
        print(__doc__)
        return 2
    verb, paths = argv[0], argv[1:] or discover()
    failed = 0
    for path in paths:
        actual, results = run(path, record=verb == "regen")
        target = record_path(path)
        changed = results_diff(path, recorded_results(path), results)
        if verb == "regen":
            target.write_text(actual)
            write_results(path, results)
            print(f"recorded {target.relative_to(ROOT)}")
            if changed:  # the prose around these values was written for the old ones
                print(changed + "  reread the prose at each place shown")
            continue
        recorded = target.read_text() if target.exists() else ""
        if recorded != actual or changed:
            failed += 1
            print(diff(path, recorded, actual) + changed + regen_hint(path))
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
