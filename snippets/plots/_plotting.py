"""What every plot script shares: loading an experiment by path, and a matplotlib
set up to write byte-for-byte reproducible SVG that reads well on any screen."""

import importlib.util
from pathlib import Path

import matplotlib
from cycler import cycler

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# A plot is WIDTH_IN inches (72 SVG units each) wide, drawn at its natural width
# (96 CSS px an inch) on a desktop and shrunk to a phone's 358-px column: there
# FONT_PT text is still FONT_PT * 358 / (72 * WIDTH_IN) px, about 11.
WIDTH_IN = 5.0
FONT_PT = 11.5
# Drawn in black and in dark, colour-blind-safe colours (Okabe and Ito's blue,
# vermilion and bluish green) on no background. The site inverts lightness for
# its dark scheme (book.css), so one SVG serves both: these turn light there.
COLOURS = ["#0072b2", "#d55e00", "#009e73"]
STYLE = {
    "axes.prop_cycle": cycler(color=COLOURS),
    "svg.hashsalt": "inside-deepinfer",
    "svg.fonttype": "none",  # text stays text: selectable, and sized by the page
    "font.size": FONT_PT,
    "axes.titlesize": FONT_PT,
    "legend.fontsize": FONT_PT,
    "legend.frameon": False,
    "grid.linewidth": 0.4,  # grids are faint: a guide for the eye, not data
    "grid.alpha": 0.5,
    "savefig.transparent": True,
}


def load_experiment(relative: str):
    """Import snippets/<relative> as a module, so a plot uses the experiment's own data."""
    path = ROOT / "snippets" / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reproducible_pyplot():
    """pyplot with a fixed SVG hash salt, text kept as text, and the book's sizes."""
    plt.rcParams.update(STYLE)
    return plt


def figure(height_in: float):
    """One axes on a figure of the book's width."""
    return plt.subplots(figsize=(WIDTH_IN, height_in))


def save_svg(fig, out: str) -> None:
    """No date and no creator string: a new matplotlib alone does not make a plot stale."""
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})
