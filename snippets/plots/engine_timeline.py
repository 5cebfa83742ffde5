"""Plot: the engine's measured step timeline, async scheduling off and on.

Usage: python snippets/plots/engine_timeline.py OUT.svg
The spans come from the data the Chapter 3 timeline demo saved under make regen
(snippets/plots/data/engine_timeline.json): a few steps of each run, each stage
a bar on the thread that ran it. The times are one machine's, on one run.

Both panels share one time axis, so that bars of equal length are equal times.
Each panel's title gives the range of its forward passes, and the "on" panel's
also how much longer or shorter they were than the "off" ones, on average, all computed
here from the saved spans. The saved window starts at the first shown step's
schedule; with async scheduling on, the step before it is still running then,
on the worker, and its spans are not in the window: a hatched bar marks where
the worker was busy with it until the first shown forward began. The gaps
between forwards on the worker are far too short to see as bars, so a marker
stands above each, and the legend gives their range.
"""

import json
import sys
from statistics import mean

from _plotting import ROOT, WIDTH_IN, reproducible_pyplot, save_svg

DATA = ROOT / "snippets" / "plots" / "data" / "engine_timeline.json"
# Okabe and Ito's colour-blind-safe palette, one colour a stage.
STAGE_COLOURS = {
    "schedule": "#e69f00",
    "prepare": "#0072b2",
    "forward": "#009e73",
    "update": "#d55e00",
    "process": "#cc79a7",
}
LANES = ["worker", "main"]  # top to bottom, where a run has both


def forwards(spans: list) -> list[float]:
    """Each forward pass's length in ms, in step order."""
    return [end - start for _, stage, _, start, end in sorted(spans) if stage == "forward"]


def titles(data: dict) -> dict[str, str]:
    """'async off: forwards 4.3-4.6 ms', and for 'on' how much longer or shorter, on average."""
    out = {}
    base = mean(forwards(data["off"]))
    for name, spans in data.items():
        f = forwards(spans)
        out[name] = f"async {name}: forwards {min(f):.1f}–{max(f):.1f} ms"
        if name != "off":
            change = mean(f) / base - 1
            out[name] += f", {abs(change):.0%} {'longer' if change >= 0 else 'shorter'}"
    return out


def mark_step_before(ax, spans: list, lanes: list[str]) -> None:
    """With the forward on a worker, the step before the window is still running when
    the window opens: hatch the worker's lane up to the first shown forward."""
    if "worker" not in lanes:
        return
    first = min(spans, key=lambda s: (s[0], s[3]))[0]
    start = min(s for step, stage, _, s, _ in spans if stage == "forward" and step == first)
    y = lanes.index("worker")
    ax.broken_barh(
        [(0, start)],
        (y - 0.35, 0.7),
        facecolor="none",
        edgecolor=STAGE_COLOURS["forward"],
        hatch="///",
        lw=0.8,
    )
    ax.text(start / 2, y, str(first - 1), ha="center", va="center")


def gaps(spans: list) -> list[tuple[float, float]]:
    """(where, how long) for each gap between one forward on the worker and the next."""
    runs = sorted(
        (s, e) for _, stage, lane, s, e in spans if stage == "forward" and lane == "worker"
    )
    return [
        ((a_end + b_start) / 2, b_start - a_end) for (_, a_end), (b_start, _) in zip(runs, runs[1:])
    ]


def main(out: str) -> None:
    data = json.loads(DATA.read_text())
    plt = reproducible_pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH_IN, 4.8), sharex=True)
    heads = titles(data)
    between = [g for spans in data.values() for g in gaps(spans)]
    for ax, (name, spans) in zip(axes, data.items()):
        lanes = sorted({lane for _, _, lane, _, _ in spans}, key=LANES.index)
        for step, stage, lane, start, end in spans:
            y = lanes.index(lane)
            ax.broken_barh(
                [(start, end - start)], (y - 0.35, 0.7), color=STAGE_COLOURS[stage], lw=0
            )
            if stage == "forward":
                ax.text((start + end) / 2, y, str(step), ha="center", va="center", color="white")
        mark_step_before(ax, spans, lanes)
        for where, _ in gaps(spans):  # too short to see as bars: a marker above each
            ax.plot(where, lanes.index("worker") + 0.5, "kv", ms=6, clip_on=False)
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.set_title(heads[name], loc="left")
        ax.grid(True, axis="x")
    axes[-1].set_xlim(0, max(end for spans in data.values() for *_, end in spans))
    axes[-1].set_xlabel("time (ms), one run on one machine")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STAGE_COLOURS.values()]
    labels = list(STAGE_COLOURS)
    if between:
        handles.append(plt.Line2D([], [], color="k", marker="v", ms=6, ls="none"))
        lengths = [length for _, length in between]
        low, high = f"{min(lengths):.2f}", f"{max(lengths):.2f}"
        labels.append(f"gap {low} ms" if low == high else f"gap {low}–{high} ms")
    fig.legend(handles, labels, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
