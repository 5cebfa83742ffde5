"""Plot: how often a gap between tokens, or a wait for the first one, is longer
than x, for each of Experiment 26's three arrangements of two GPUs.

Usage: python snippets/plots/pd_interference.py OUT.svg
The workload, the cost model and the three arms are the experiment's own,
imported by path and run at the rate of its first table. Both axes are
logarithmic: the stalls that set the colocated arm apart are under one gap in
a hundred, so a plain CDF would hide them against its top edge.
"""

import bisect
import random
import sys

from _plotting import WIDTH_IN, load_experiment, reproducible_pyplot, save_svg

STYLES = {"colocated": "-", "chunked": "--", "disaggregated": ":"}
# The x grids, in ms: a point every few percent along each log axis.
ITL_RANGE = (2.0, 300.0)
TTFT_RANGE = (5.0, 1000.0)
POINTS = 240


def log_grid(low: float, high: float) -> list[float]:
    return [low * (high / low) ** (i / (POINTS - 1)) for i in range(POINTS)]


def longer_than(values_ms: list[float], grid: list[float], floor: float) -> list[float]:
    """For each x of the grid, the share of values above it. A log axis cannot
    draw zero: the first x past the largest value drops to the axis' floor, so
    that a curve visibly ends there, and the rest is None."""
    ranked, n = sorted(values_ms), len(values_ms)
    shares = [(n - bisect.bisect_right(ranked, x)) / n for x in grid]
    ended = [s == 0 and (i == 0 or shares[i - 1] > 0) for i, s in enumerate(shares)]
    return [s if s > 0 else (floor if end else None) for s, end in zip(shares, ended)]


def panel(
    ax, stats: dict, key: str, span: tuple, slo_ms: float, floor: float, tag_y: float
) -> None:
    grid = log_grid(*span)
    for (arm, lat), colour in zip(stats.items(), ("C0", "C1", "C2")):
        shares = longer_than([1e3 * v for v in lat[key]], grid, floor)
        ax.plot(grid, shares, color=colour, ls=STYLES[arm], lw=1.6, label=arm)
    ax.axvline(slo_ms, color="black", lw=0.8, ls="-.")
    ax.text(slo_ms / 1.08, tag_y, "SLO", ha="right", va="center")  # left of its line
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(*span)
    ax.set_ylim(floor, 1.5)
    ticks = [t for t in (2, 5, 10, 20, 50, 100, 200, 500, 1000) if span[0] <= t <= span[1]]
    ax.set_xticks(ticks, [str(t) for t in ticks])  # plain text, no mathtext powers
    ax.minorticks_off()
    shares = [s for s in (1e-4, 1e-3, 1e-2, 0.1, 1.0) if s >= floor]
    ax.set_yticks(shares, [f"{100 * s:g}%" for s in shares])
    ax.grid(True)


def main(out: str) -> None:
    e26 = load_experiment("ch08/e26_pd_interference.py")
    plt = reproducible_pyplot()
    requests = e26.workload(random.Random(e26.SEED), e26.RATE)
    stats = {arm: e26.latencies(requests, t) for arm, t in e26.arms(requests).items()}

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(WIDTH_IN, 6.6))
    panel(top, stats, "itl", ITL_RANGE, 1e3 * e26.ITL_SLO_S, 1e-4, 3e-4)
    top.set_xlabel("gap between two tokens, ms")
    top.set_ylabel("gaps longer")
    top.legend(loc="upper right", handlelength=2.2)
    panel(bottom, stats, "ttft", TTFT_RANGE, 1e3 * e26.TTFT_SLO_S, 1e-3, 0.4)
    bottom.set_xlabel("time to first token, ms")
    bottom.set_ylabel("requests waiting longer")
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
