"""Demo: DeepSeek-V4's paged cache grows at the compressed rate, not the token rate.

No trained V4 model is small enough to ship, so the demo builds one with random
weights: transformers' DeepseekV4ForCausalLM at a toy width, seeded, with one
layer of each attention type and V4's own rates (a window of WINDOW raw tokens,
CSA's one row per 4 tokens, HCA's one per 128), saved with deepinfer-tiny-moe's
tokenizer. The engine serves it as it would a real checkpoint.

One request runs a PROMPT-token prompt in chunks of CHUNK and a REPLY-token
reply, stepped by hand so that after every step we can count the blocks it
holds, token blocks and row blocks. At a few context lengths (each just after a
prompt chunk, whose blocks it still holds) the demo prints those blocks beside
what a cache keeping every token would hold, the bytes of the pool they are per
token of context, and the bytes per token of a plain cache of the same width:
one head_dim row per token and layer, every token kept. At the end it prints
each part's bytes in a token block and in a row block, the compressed rows each
layer wrote (watched as they are written), and the blocks the window gave back.
Every count depends only on lengths, never on the random weights' choices.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.kv.compressed_cache import ROW_GROUP
from engine.layers import compressor
from engine.scheduler_output import HOLE
from engine.utils import cdiv

TOKENIZER = Path(os.environ.get("DEEPINFER_DEMO_MODEL_MOE", "snippets/models/deepinfer-tiny-moe"))
LAYERS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
WINDOW, CSA_RATE, HCA_RATE = 128, 4, 128  # V4's own (transformers' DeepseekV4Config)
SHORT = {LAYERS[0]: "sliding", LAYERS[1]: "CSA", LAYERS[2]: "HCA"}
BLOCK, CHUNK = 16, 64
PROMPT, REPLY = 4032, 64
CHECKPOINTS = (1024, 2048, 3072, 4032)  # context lengths at which blocks are printed


def build(folder: Path) -> Path:
    """A random DeepseekV4ForCausalLM checkpoint with one layer of each type."""
    import transformers

    config = transformers.DeepseekV4Config(
        vocab_size=4096, hidden_size=64, num_attention_heads=4, head_dim=32,
        q_lora_rank=24, o_groups=2, o_lora_rank=16, partial_rotary_factor=0.25,
        layer_types=LAYERS, num_hidden_layers=len(LAYERS), sliding_window=WINDOW,
        compress_rates={LAYERS[1]: CSA_RATE, LAYERS[2]: HCA_RATE},
        mlp_layer_types=["hash_moe", "moe", "moe"], n_routed_experts=8,
        num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, hc_mult=2,
        index_n_heads=4, index_head_dim=16, index_topk=64, max_position_embeddings=8192,
        initializer_range=0.1, eos_token_id=0, bos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(config).eval()
    path = folder / "v4-random"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return path


def held_blocks(llm: LLM) -> dict[int, tuple[int, int]]:
    """(token blocks, row blocks) the one request holds after each step, by tokens
    computed."""
    engine = llm.llm_engine
    prompt = [(7 * i) % 4000 + 50 for i in range(PROMPT)]
    engine.add_request("r", prompt, SamplingParams(max_tokens=REPLY, ignore_eos=True))
    held = {}
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            tokens = sum(1 for b in seq.block_table if b != HOLE)
            held[seq.num_computed_tokens] = (tokens, len(seq.block_tables[ROW_GROUP]))
    return held


@contextmanager
def watching_rows(llm: LLM) -> Iterator[list[set[int]]]:
    """Per layer, the slots of its row blocks that its compressor writes rows into,
    gathered while the demo runs. (The pool cannot tell: a row block's page may
    have been a token block before, and keeps that block's numbers until a row
    is written over them.)"""
    layers = llm.llm_engine.executor.model_runner.model.attention_layers()
    seen: list[set[int]] = [set() for _ in layers]
    write = compressor.write

    def watched(cache: torch.Tensor, where: torch.Tensor, values: torch.Tensor) -> None:
        for i, layer in enumerate(layers):
            if cache is layer.kv_cache.rows:
                seen[i].update(where.tolist())
        write(cache, where, values)

    compressor.write = watched
    try:
        yield seen
    finally:
        compressor.write = write


def part_bytes(spec, span: int) -> list[int]:
    """Bytes of kv, state and indexer state in a token block, then of rows and
    indexer keys in a row block, for one layer's spec."""
    token_parts = (spec.head_dim, spec.state_dim, spec.index_state_dim)
    rows = span // spec.rate if spec.rate else 0
    numbers = [BLOCK * w for w in token_parts] + [rows * spec.row_dim, rows * spec.index_key_dim]
    return [n * 4 for n in numbers]  # float32


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(build(Path(tmp)), dtype="float32", block_size=BLOCK,
                  max_num_batched_tokens=CHUNK, num_kv_blocks=64)  # fmt: skip
        with watching_rows(llm) as seen:
            held = held_blocks(llm)
        rows = [len(slots) for slots in seen]
    [row_group] = llm.llm_engine.config.kv_cache_groups.spans
    span = row_group.span
    pool = llm.llm_engine.executor.model_runner.kv_cache
    block_bytes = pool.block_bytes()
    [spec] = pool.specs  # every layer's parts, in one page per block
    plain = len(LAYERS) * spec.layers[0].head_dim * 4  # float32, every token kept
    print(f"blocks of {BLOCK} tokens, {block_bytes} bytes each")
    print(f"row span: {span} tokens; window: {WINDOW} tokens")
    print(f"{'':>8}{'blocks held':>13}{'every':>8}{'bytes/token':>14}")
    print(f"{'context':>8}{'token':>7}{'row':>6}{'token':>8}{'ours':>7}{'plain':>7}")
    results: dict = {"block": BLOCK, "span": span, "window": WINDOW, "prompt": PROMPT}
    for n in CHECKPOINTS:
        tokens, row_blocks = held[n]
        per_token = round((tokens + row_blocks) * block_bytes / n)
        every = cdiv(n, BLOCK)
        print(f"{n:>8}{tokens:>7}{row_blocks:>6}{every:>8}{per_token:>7}{plain:>7}")
        results |= {
            f"tokens_{n}": tokens,
            f"rows_{n}": row_blocks,
            f"held_{n}": tokens + row_blocks,
            f"every_{n}": every,
            f"bytes_{n}": per_token,
        }
    computed = PROMPT + REPLY - 1  # the reply's last token is sampled, never run
    print("bytes in a token block: raw rows, compressor")
    print("state, indexer state; in a row block: rows,")
    print("indexer keys; and the rows written in all")
    print(f"{'':<9}{'raw':>6}{'state':>7}{'istate':>7}{'rows':>6}{'ikeys':>6}{'written':>9}")
    for kind, layer_spec, count in zip(LAYERS, spec.layers, rows):
        size = part_bytes(layer_spec, span)
        widths = (6, 7, 7, 6, 6)
        print(
            f"{SHORT[kind]:<9}" + "".join(f"{b:>{w}}" for b, w in zip(size, widths)) + f"{count:>9}"
        )
    token_bytes = sum(sum(part_bytes(s, span)[:3]) for s in spec.layers)
    row_bytes = sum(sum(part_bytes(s, span)[3:]) for s in spec.layers)
    print(f"parts of a token block: {token_bytes} bytes")
    print(f"parts of a row block: {row_bytes} bytes")
    limit, rows_alone = round(block_bytes / span), round(row_bytes / span)
    print(f"bytes a token in the limit: {limit}")
    print(f"of which the rows take: {rows_alone}")
    most = max(sum(h) for h in held.values())
    print(f"most blocks held at once: {most}")
    print(f"tokens computed: {computed}")
    print(f"blocks the window gave back: {llm.stats.window_freed_blocks}")
    return results | {
        "most": most,
        "rows_sliding": rows[0],
        "rows_csa": rows[1],
        "rows_hca": rows[2],
        "freed": llm.stats.window_freed_blocks,
        "block_bytes": block_bytes,
        "token_bytes": token_bytes,
        "row_bytes": row_bytes,
        "plain_bytes": plain,
        "limit_bytes": limit,
        "rows_alone_bytes": rows_alone,
        "computed": computed,
    }


if __name__ == "__main__":
    main()
