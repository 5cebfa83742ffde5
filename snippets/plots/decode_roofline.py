"""Plot: the decode-step roofline of Experiment 2 (tokens/s against batch size).

Usage: python snippets/plots/decode_roofline.py OUT.svg
The curves come from the experiment's own functions, imported by path.
"""

import sys

from _plotting import figure, load_experiment, reproducible_pyplot, save_svg


def main(out: str) -> None:
    e02 = load_experiment("ch01/e02_decode_roofline.py")
    reproducible_pyplot()
    batches = list(range(1, 1025))
    memory_roof = [b / e02.step_times(b)[0] for b in batches]
    compute_roof = e02.PEAK_FLOP_PER_S / (2 * e02.PARAMS)
    achieved = [e02.tokens_per_s(b) for b in batches]
    ridge = e02.ridge_batch()

    fig, ax = figure(3.6)
    ax.plot(batches, memory_roof, "--", color="C0", lw=1.2, label="weight reads alone")
    ax.axhline(compute_roof, ls="--", color="C1", lw=1.2, label="tensor cores alone")
    ax.plot(batches, achieved, color="black", lw=2, label="the slower bound")
    ax.axvline(ridge, color="grey", lw=0.8, ls=":")
    ax.annotate(
        f"ridge: batch {ridge:.0f}",
        xy=(ridge, compute_roof),
        xytext=(ridge / 12, compute_roof * 1.6),
        arrowprops={"arrowstyle": "->", "color": "grey"},
    )
    ax.set_xscale("log", base=2)
    ticks = [1, 4, 16, 64, 256, 1024]
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.set_yscale("log")
    ax.set_ylim(100, 1_000_000)
    yticks = [100, 1_000, 10_000, 100_000, 1_000_000]
    ax.set_yticks(yticks, [f"{t:,}" for t in yticks])
    ax.minorticks_off()
    ax.set_xlabel("batch size (requests in one step)")
    ax.set_ylabel("tokens per second")
    ax.grid(True, which="major")
    ax.legend(loc="lower right")
    fig.tight_layout()
    save_svg(fig, out)


if __name__ == "__main__":
    main(sys.argv[1])
