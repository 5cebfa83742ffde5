"""Plot: tokens dropped and rows padded against the capacity factor, from Experiment 15.

Usage: python snippets/plots/capacity_tradeoff.py OUT.svg
The batch, the routers and the counting are the experiment's own, imported by
path; the plot only sweeps the capacity factor more finely than its table.
"""

import sys

from _plotting import figure, load_experiment, reproducible_pyplot, save_svg


def main(out: str) -> None:
    e15 = load_experiment("ch04/e15_capacity_factor.py")
    reproducible_pyplot()
    factors = [1 + i / 20 for i in range(61)]  # 1.0 to 4.0
    fig, ax = figure(4.2)
    for colour, (name, skew) in zip(["C0", "C1"], e15.SKEWS.items()):
        counts = e15.loads(skew, e15.TOKENS)
        waste = [e15.dropped_and_padding(counts, e15.capacity(f, e15.TOKENS)) for f in factors]
        ax.plot(
            factors,
            [100 * d for d, _ in waste],
            color=colour,
            lw=1.4,
            marker="o",
            markersize=3,
            markevery=4,
            label=f"{name}: dropped",
        )
        ax.plot(
            factors,
            [100 * p for _, p in waste],
            color=colour,
            lw=1.4,
            ls="--",
            label=f"{name}: padding",
        )
    ax.set_xlim(factors[0], factors[-1])
    # Linear below one percent, logarithmic above: the even router's few
    # percent of drops, and their fall to zero, stay visible beside the rest.
    ax.set_yscale("symlog", linthresh=1)
    ax.set_ylim(0, 100)
    ticks = [0, 1, 10, 100]
    ax.set_yticks(ticks, [str(t) for t in ticks])  # plain text, no mathtext powers
    ax.set_xlabel("capacity factor")
    ax.set_ylabel("share (%)")
    ax.grid(True)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2)
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
