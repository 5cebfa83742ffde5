"""Plot: KV slots wasted against request length, from Experiment 5's request stream.

Usage: python snippets/plots/fragmentation_waste.py OUT.svg
Each line passes through the 1,000 simulated requests, sorted by length; the data
come from the experiment's own functions, imported by path.
"""

import sys

from _plotting import load_experiment, reproducible_pyplot, save_svg


def main(out: str) -> None:
    e05 = load_experiment("ch02/e05_fragmentation.py")
    plt = reproducible_pyplot()
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
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
