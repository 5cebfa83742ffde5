"""Plot: the engine's measured step timeline, async scheduling off and on.

Usage: python snippets/plots/engine_timeline.py OUT.svg
The spans come from the data the Chapter 3 timeline demo saved under make regen
(snippets/plots/data/engine_timeline.json): a few steps of each run, each stage
a bar on the thread that ran it. The times are one machine's, on one run.
"""

import json
import sys

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


def main(out: str) -> None:
    data = json.loads(DATA.read_text())
    plt = reproducible_pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(WIDTH_IN, 4.2))
    for ax, (name, spans) in zip(axes, data.items()):
        lanes = sorted({lane for _, _, lane, _, _ in spans}, key=["worker", "main"].index)
        for step, stage, lane, start, end in spans:
            y = lanes.index(lane)
            ax.broken_barh(
                [(start, end - start)], (y - 0.35, 0.7), color=STAGE_COLOURS[stage], lw=0
            )
            if stage == "forward":
                ax.text((start + end) / 2, y, str(step), ha="center", va="center", color="white")
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_ylim(-0.6, len(lanes) - 0.4)
        ax.set_xlim(0, max(end for *_, end in spans))
        ax.set_title(f"async scheduling {name}", loc="left")
        ax.grid(True, axis="x")
    axes[-1].set_xlabel("time (ms), one run on one machine")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in STAGE_COLOURS.values()]
    fig.legend(handles, STAGE_COLOURS, loc="lower center", ncol=3)
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
