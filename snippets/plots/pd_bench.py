"""Plot: one run of `deepinfer bench --pd`'s interference part, the built service's
latencies with two colocated workers against one prefill and one decode worker.

Usage: python snippets/plots/pd_bench.py OUT.svg
The percentiles come from the run saved by
`python -m engine.tools.pd_bench --part interference --save snippets/plots/data/pd_bench.json`
(snippets/plots/data/pd_bench.json): one machine's, on one run, which the title
names. For each latency and each service, p50 and p99 are two markers joined by
a line, on a logarithmic axis, since a first token waits seconds where a gap
between two tokens takes tens of milliseconds. Points, not bars: on a log axis a
bar's length would depend on where the axis happens to start.
"""

import json
import sys

from _plotting import ROOT, WIDTH_IN, reproducible_pyplot, save_svg
from matplotlib.lines import Line2D

DATA = ROOT / "snippets" / "plots" / "data" / "pd_bench.json"
SIDES = {"colocated": "two colocated workers", "split": "prefill + decode worker"}
MARKERS = {"p50": "o", "p99": "D"}  # the order of each side's two values in the data
# p50 is drawn over p99, with a white rim, so that it still shows where the two meet.
STYLES = {"p50": {"ms": 7.5, "mec": "white", "zorder": 3}, "p99": {"ms": 9, "zorder": 2}}


def main(out: str) -> None:
    run = json.loads(DATA.read_text())
    plt = reproducible_pyplot()
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = list(run["ms"])
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 4.6))
    shift = 0.18
    for side, offset, colour in zip(SIDES, (-shift, shift), colours):
        for y, label in enumerate(labels):
            values = run["ms"][label][side]
            ax.plot(values, [y + offset] * len(values), color=colour, lw=1.6)
            for value, (q, marker) in zip(values, MARKERS.items()):
                ax.plot([value], [y + offset], marker=marker, color=colour, ls="none", **STYLES[q])
    ax.set_yticks(range(len(labels)), labels)
    ax.set_ylim(len(labels) - 0.5, -0.5)  # the first latency on top
    ax.set_xscale("log")
    ticks = [t for t in (10, 30, 100, 300, 1000, 3000, 10000, 30000)]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])  # plain text, no mathtext powers
    ax.minorticks_off()
    low = min(v for cells in run["ms"].values() for side in cells.values() for v in side)
    high = max(v for cells in run["ms"].values() for side in cells.values() for v in side)
    ax.set_xlim(low / 2, high * 2)
    ax.set_xlabel("ms, one run (logarithmic axis)")
    ax.set_title(run["machine"])
    ax.grid(True, axis="x")
    handles = [Line2D([], [], color=c, lw=1.6, label=n) for c, n in zip(colours, SIDES.values())]
    handles += [
        Line2D([], [], color="black", marker=m, ls="none", label=q, **STYLES[q])
        for q, m in MARKERS.items()
    ]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
