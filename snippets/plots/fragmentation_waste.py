"""Plot: KV slots wasted against request length, from Experiment 5's request stream.

Usage: python snippets/plots/fragmentation_waste.py OUT.svg
Each line passes through the 1,000 simulated requests, sorted by length; the data
come from the experiment's own functions, imported by path.
"""

import importlib.util
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENT = ROOT / "snippets" / "ch02" / "e05_fragmentation.py"


def load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out: str) -> None:
    e05 = load(EXPERIMENT)
    plt.rcParams.update({"svg.hashsalt": "inside-deepinfer", "svg.fonttype": "none"})
    lengths = sorted(e05.request_lengths())
    shown = {
        f"contiguous, {e05.MAX_LEN} reserved": (None, "tab:red"),
        "paged, block 256": (256, "tab:orange"),
        "paged, block 16": (16, "tab:blue"),
    }

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, (block, color) in shown.items():
        waste = [100 * e05.waste(n, block) for n in lengths]
        ax.plot(lengths, waste, color=color, lw=1, label=label)
    ax.set_xlim(0, e05.MAX_LEN)
    ax.set_ylim(0, 100)
    ax.set_xlabel("request length at its longest (prompt + output tokens)")
    ax.set_ylabel("reserved KV slots never used (%)")
    ax.set_title(f"{len(lengths):,} simulated requests, seed {e05.SEED} (model, not measured)")
    ax.grid(True, lw=0.4, alpha=0.5)
    ax.legend(loc="upper right", frameon=False)
    fig.tight_layout()
    fig.savefig(out, format="svg", metadata={"Date": None, "Creator": None})


if __name__ == "__main__":
    main(sys.argv[1])
