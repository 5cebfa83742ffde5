"""Plot: deepinfer-tiny-moe's per-expert load on a chapter of this book, as a heatmap.

Usage: python snippets/plots/expert_load.py OUT.svg
The counts are the Chapter 4 demo's recorded results (snippets/ch04/demo_expert_load.json):
for each MoE layer, the (token, expert) pairs its router sent to each routed expert,
drawn as that expert's load over the layer's mean. Thin lines split the expert groups.
"""

import json
import sys

from _plotting import ROOT, figure, reproducible_pyplot, save_svg

RECORD = ROOT / "snippets" / "ch04" / "demo_expert_load.json"


def main(out: str) -> None:
    r = json.loads(RECORD.read_text())
    rows = [r[f"load_layer_{layer}"] for layer in r["moe_layers"]]
    ratio = [[n * len(row) / sum(row) for n in row] for row in rows]
    plt = reproducible_pyplot()
    fig, ax = figure(0.9 + 0.45 * len(rows))
    image = ax.imshow(ratio, cmap="Blues", vmin=0, aspect="auto")
    experts = r["num_experts"]
    for g in range(1, r["num_groups"]):
        ax.axvline(g * experts / r["num_groups"] - 0.5, color="black", lw=0.8)
    ax.set_xticks(range(0, experts, 2))
    ax.set_yticks(range(len(rows)), [str(layer) for layer in r["moe_layers"]])
    ax.set_xlabel("routed expert")
    ax.set_ylabel("layer")
    fig.colorbar(image, ax=ax, label="load / mean", pad=0.02)
    fig.tight_layout()
    save_svg(fig, out)
    plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1])
