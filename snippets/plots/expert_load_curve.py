"""Plot: each expert's tokens over the mean, busiest first, from Experiment 12's rows.

Usage: python snippets/plots/expert_load_curve.py OUT.svg
The rows, the router and the seeds are the experiment's own, imported by path:
the plot draws the same loads that its table summarises.
"""

import sys

from _plotting import figure, load_experiment, reproducible_pyplot, save_svg
from matplotlib.ticker import NullFormatter


def main(out: str) -> None:
    e12 = load_experiment("ch04/e12_routing_skew.py")
    reproducible_pyplot()
    fig, ax = figure(3.6)
    styles = ["C0", "C1", "C2"]
    for i, (skew, balanced) in enumerate(e12.ROWS):
        loads = sorted(e12.row_loads(skew, balanced), reverse=True)
        mean = sum(loads) / len(loads)
        label = f"skew {skew:g}" + (", bias" if balanced else "")
        colour, dash = (styles[i], "-") if not balanced else ("black", "--")
        ax.plot(
            range(1, len(loads) + 1),
            [n / mean for n in loads],
            color=colour,
            ls=dash,
            lw=1.4,
            label=label,
        )
    ax.axhline(1, color="grey", lw=0.6, label="mean")
    ax.set_xscale("log")
    ticks = [2**i for i in range(0, e12.EXPERTS.bit_length(), 2)]  # 1, 4, 16, ...
    ax.set_xticks(ticks, [str(t) for t in ticks])  # plain text, no mathtext powers
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(bottom=0)
    ax.set_xlim(1, e12.EXPERTS)
    ax.set_xlabel("experts, busiest first")
    ax.set_ylabel("tokens / mean")
    ax.grid(True)
    ax.legend(loc="upper right")
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
