"""Plot: KV slots wasted against request length, from Experiment 5's request stream.

Usage: python snippets/plots/fragmentation_waste.py OUT.svg
Each line passes through the simulated requests, sorted by length; the schemes,
their names and the data come from the experiment itself, imported by path.
"""

import sys

from _plotting import figure, load_experiment, reproducible_pyplot, save_svg


def main(out: str) -> None:
    e05 = load_experiment("ch02/e05_fragmentation.py")
    reproducible_pyplot()
    lengths = sorted(e05.request_lengths())
    # The contiguous slab, the largest block and the engine's block size.
    largest = max(b for b in e05.SCHEMES.values() if b is not None)
    colour = {None: "C1", largest: "C2", e05.BLOCK: "C0"}
    shown = [(n, b) for n, b in e05.SCHEMES.items() if b in colour]

    fig, ax = figure(3.6)
    for name, block in shown:
        waste = [100 * e05.waste(n, block) for n in lengths]
        ax.plot(lengths, waste, color=colour[block], lw=1.2, label=name)
    ax.set_xlim(0, e05.MAX_LEN)
    ax.set_ylim(0, 100)
    ax.set_xlabel("request length at its longest (tokens)")
    ax.set_ylabel("reserved slots never used (%)")
    ax.grid(True)
    ax.legend(loc="upper right")
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
