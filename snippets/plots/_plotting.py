"""What every plot script shares: loading an experiment by path, and a matplotlib
set up to write byte-for-byte reproducible SVG."""

import importlib.util
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def load_experiment(relative: str):
    """Import snippets/<relative> as a module, so a plot uses the experiment's own data."""
    path = ROOT / "snippets" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reproducible_pyplot():
    """pyplot with a fixed SVG hash salt and text kept as text (no font outlines)."""
    plt.rcParams.update({"svg.hashsalt": "inside-deepinfer", "svg.fonttype": "none"})
    return plt


def save_svg(fig, out: str) -> None:
    """No date and no creator string: a new matplotlib alone does not make a plot stale."""
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
