"""Plot: one DeepSeek-V4 request's two block tables, at a concrete length.

Usage: python snippets/plots/v4_tables.py OUT.svg
The lengths are the V4 cache demo's own (snippets/ch06/demo_v4_cache.py and its
record): its block size, row span, window and prompt chunks, in a pool of the
demo's size. No model runs: the engine's own block manager (KVCacheCoordinator)
is driven through the first CONTEXT tokens of a prompt as the scheduler drives
it, chunk by chunk (allocate, publish, then the window's give-back before the
next chunk), and the tables it leaves are drawn as they are, physical block ids
included. The worked row_slots is the newest CSA row's, computed here: the slot is
that row's place in each CSA layer's row cache.
"""

import json
import sys

from _plotting import ROOT, WIDTH_IN, load_experiment, reproducible_pyplot, save_svg

from engine.config.cache_groups import KVCacheGroups, SpanGroup
from engine.kv.compressed_cache import ROW_GROUP
from engine.kv.coordinator import KVCacheCoordinator
from engine.kv.hashing import chain_root
from engine.sampling_params import SamplingParams
from engine.scheduler_output import HOLE
from engine.sequence import Sequence

CONTEXT = 1024  # one of the demo's checkpoints: just after a prompt chunk
TOKEN_GROUP = 0  # every model's first KV-cache group (config/cache_groups.py)
POOL = 64  # the demo's num_kv_blocks
TOKEN, ROW, GIVEN = "#0072b2", "#009e73", "#bbbbbb"


def tables() -> tuple[dict, Sequence]:
    """The demo's lengths, and a sequence whose first CONTEXT tokens ran in chunks."""
    demo = load_experiment("ch06/demo_v4_cache.py")
    record = json.loads((ROOT / "snippets/ch06/demo_v4_cache.json").read_text())
    sizes = {k: record[k] for k in ("block", "span", "window")} | {"chunk": demo.CHUNK}
    sizes["csa_rate"] = demo.CSA_RATE
    groups = KVCacheGroups(sizes["block"], sizes["window"], (SpanGroup(sizes["span"]),))
    manager = KVCacheCoordinator(POOL, groups, True, chain_root("v4", "float32", sizes["block"]))
    seq = Sequence("r", list(range(CONTEXT + 1)), SamplingParams())
    while seq.num_computed_tokens < CONTEXT:  # as Scheduler._slide, then _reserve
        manager.free_outside_window(seq, 0, sizes["window"])
        assert manager.allocate(seq, seq.num_computed_tokens + sizes["chunk"])
        seq.num_computed_tokens += sizes["chunk"]
        manager.cache_full_blocks(seq)
    return sizes, seq


def cell(ax, x: float, y: float, w: float, colour: str, text: str) -> None:
    ax.add_patch(plt.Rectangle((x, y), w, 0.8, facecolor=colour, edgecolor="white", lw=0.8))
    ax.text(x + w / 2, y + 0.4, text, ha="center", va="center", color="white")


def main(out: str) -> None:
    sizes, seq = tables()
    token_table, row_table = seq.block_tables[TOKEN_GROUP], seq.block_tables[ROW_GROUP]
    holes, bs = token_table.count(HOLE), sizes["block"]
    held = token_table[holes:]
    in_window = sizes["window"] // bs  # the rest of the held blocks hold the newest chunk
    fig, ax = plt.subplots(figsize=(WIDTH_IN, 5.2))
    # The token group: one grey bar for the entries given back, a cell per held one.
    ax.text(0, 9.3, f"block_tables[{TOKEN_GROUP}]: {len(token_table)} entries of {bs} tokens")
    cell(ax, 0, 8.3, 2.6, GIVEN, f"{holes} HOLEs")
    width = 7.4 / len(held)
    for i, block_id in enumerate(held):
        cell(ax, 2.6 + i * width, 8.3, width, TOKEN, str(block_id))
    ax.text(2.6 + in_window * width / 2, 7.8, "window", ha="center", va="center")
    ax.text(10 - (len(held) - in_window) * width / 2, 7.8, "chunk", ha="center", va="center")
    ax.text(0, 7.2, f"tokens below {holes * bs}", va="center")
    ax.text(10, 7.2, f"tokens {holes * bs} to {CONTEXT - 1}", ha="right", va="center")
    # The span group: a cell per row span, the last one filling still.
    span, m = sizes["span"], sizes["csa_rate"]
    ax.text(0, 6.1, f"block_tables[{ROW_GROUP}]: a row block per {span} tokens")
    for j, block_id in enumerate(row_table):
        cell(ax, j * 10 / 3, 5.1, 10 / 3, ROW, str(block_id))
        last = min(CONTEXT, (j + 1) * span) - 1
        ax.text(j * 10 / 3 + 5 / 3, 4.55, f"{j * span} to {last}", ha="center", va="center")
    # The worked row_slots: the newest CSA row.
    w, per_block = CONTEXT // m - 1, span // m
    index, offset = w // per_block, w % per_block
    block = row_table[index]
    lines = [
        f"After {CONTEXT} tokens, CSA (m = {m}) has closed",
        f"{CONTEXT // m} rows: the newest is row w = {w}.",
        f"A row block holds {span} / {m} = {per_block} rows.",
        f"Table index {w} // {per_block} = {index}: block {block}.",
        f"Offset {w} % {per_block} = {offset}: slot {block} × {per_block} + {offset} = "
        f"{block * per_block + offset}",
    ]
    for k, line in enumerate(lines):
        ax.text(0, 3.5 - 0.75 * k, line)
    ax.set_xlim(0, 10)
    ax.set_ylim(-0.2, 9.7)
    ax.axis("off")
    fig.tight_layout()
    save_svg(fig, out)


plt = reproducible_pyplot()

if __name__ == "__main__":
    main(sys.argv[1])
