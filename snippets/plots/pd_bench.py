"""Plot: one run of `deepinfer bench --pd`'s interference part, the built service's
latencies with two colocated workers against one prefill and one decode worker.

Usage: python snippets/plots/pd_bench.py OUT.svg
The percentiles come from the run saved by
`python -m engine.tools.pd_bench --part interference --save snippets/plots/data/pd_bench.json`
(snippets/plots/data/pd_bench.json): one machine's, on one run, which the title
names. For each latency, p50 and p99 of the colocated and of the split service,
on a logarithmic axis, since a first token waits seconds where a gap between two
tokens takes tens of milliseconds.
"""

import json
import sys

from _plotting import ROOT, WIDTH_IN, reproducible_pyplot, save_svg

DATA = ROOT / "snippets" / "plots" / "data" / "pd_bench.json"
SIDES = {"colocated": "two colocated workers", "split": "prefill + decode worker"}


def main(out: str) -> None:
    run = json.loads(DATA.read_text())
    plt = reproducible_pyplot()
    rows = [(label, q, i) for label in run["ms"] for i, q in enumerate(("p50", "p99"))]
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.2))
    height = 0.38
    for shift, (side, name) in zip((-height / 2, height / 2), SIDES.items()):
        values = [run["ms"][label][side][i] for label, _, i in rows]
        ys = [y + shift for y in range(len(rows))]
        ax.barh(ys, values, height=height, label=name)
    ax.set_yticks(range(len(rows)), [f"{label} {q}" for label, q, _ in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ticks = [t for t in (10, 30, 100, 300, 1000, 3000, 10000, 30000)]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks])  # plain text, no mathtext powers
    ax.minorticks_off()
    low = min(v for cells in run["ms"].values() for side in cells.values() for v in side)
    high = max(v for cells in run["ms"].values() for side in cells.values() for v in side)
    ax.set_xlim(max(1.0, low / 2), high * 2)
    ax.set_xlabel("ms, one run")
    ax.set_title(run["machine"])
    ax.grid(True, axis="x")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1)
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
