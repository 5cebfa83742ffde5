"""Plot: speedup against draft length k, one line per draft-to-target cost ratio c.

Usage: python snippets/plots/speculative_speedup.py OUT.svg
The acceptance rate, the cost ratios and the speedup model come from
Experiment 18 itself, imported by path; each line's peak is marked.
"""

import sys

from _plotting import WIDTH_IN, load_experiment, reproducible_pyplot, save_svg

# Narrower than the book's other plots: a phone shrinks every plot to its column,
# so a figure of 0.8 times the width keeps the same text 1.25 times as large there
# (about 14 px), while a desktop, which draws it at its natural size, sees the
# usual text size.
SCALE = 0.8


def main(out: str) -> None:
    e18 = load_experiment("ch05/e18_speedup_vs_k.py")
    plt = reproducible_pyplot()
    ks = list(range(1, e18.MAX_K + 1))

    fig, ax = plt.subplots(figsize=(WIDTH_IN * SCALE, 3.3))
    ax.axhline(1.0, color="black", lw=0.8, ls="--", label="plain decoding")
    top = 0.0
    for c, colour in zip(e18.RATIOS, ("C0", "C1", "C2")):
        speedups = e18.curve(e18.ALPHA, c)
        top = max(top, *speedups)
        ax.plot(ks, speedups, color=colour, lw=1.4, marker="o", ms=3, label=f"c = {c}")
        best = e18.best_k(e18.ALPHA, c)
        peak = e18.speedup(e18.ALPHA, best, c)
        ax.plot([best], [peak], color=colour, marker="*", ms=11)
    ax.set_xlim(0.5, e18.MAX_K + 0.5)
    ax.set_ylim(0, 1.4 * top)  # headroom: the legend sits above the curves, not on one
    ax.set_xticks(ks)
    ax.set_xlabel("draft length k")
    ax.set_ylabel("speedup over plain decoding")
    ax.grid(True)
    ax.legend(loc="upper left", ncol=2, handlelength=1.5, columnspacing=1.0)
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
