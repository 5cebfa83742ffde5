"""Demo: the engine's KV formats side by side, in bytes per token and layer.

Every number below comes from the engine's own cache specs (engine/kv/), never
from a formula typed here. First the specs are built at published shapes:
Meta-Llama-3-8B's grouped-query attention, a multi-head attention of the same
width, DeepSeek-V3's MLA latent and DeepSeek-V3.2's latent with its indexer
keys, each with its numbers in bfloat16 and, where the engine allows it, as
FP8 E4M3 or int8 codes with their scales; bytes per token and layer are
spec.block_bytes(BLOCK_SIZE) / BLOCK_SIZE. Then a sliding window's bound on
the blocks a request holds, at a sample window. Then the shipped tiny models
are loaded through the real cache pool, in each kv_cache_dtype, and the demo
prints what the pool allocates, and the root of the hash chains that name
its blocks in the prefix cache. Last, one request on deepinfer-tiny runs
under a small window and counts the blocks it holds after every step.
"""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.config.kv_format import FORMATS
from engine.kv.hashing import chain_hash, chain_root
from engine.kv.kv_cache import FullAttentionSpec, KVCacheSpec, MLACacheSpec
from engine.kv.sparse_cache import IndexedLatentSpec
from engine.scheduler_output import HOLE
from engine.utils import cdiv

BLOCK_SIZE = 16
DTYPE = torch.bfloat16
KV_DTYPES = ("auto", *FORMATS)  # auto, fp8_e4m3, int8

# Published shapes, from each model's config.json on Hugging Face (the repo
# beside each). Meta-Llama-3-8B sets hidden_size 4096 and 32 heads, so
# head_dim is 4096 / 32; DeepSeek-V3.2-Exp keeps DeepSeek-V3's MLA shape.
LLAMA = dict(name="Meta-Llama-3-8B", heads=32, kv_heads=8, head_dim=128)
DEEPSEEK = dict(name="DeepSeek-V3", kv_lora_rank=512, qk_rope_head_dim=64)
V32 = dict(name="DeepSeek-V3.2", index_head_dim=128)
SOURCES = (
    ("GQA", "meta-llama/Meta-Llama-3-8B"),
    ("MHA", "the same, a KV head per head"),
    ("MLA", "deepseek-ai/DeepSeek-V3"),
    ("DSA", "deepseek-ai/DeepSeek-V3.2-Exp"),
)

# A sample window: the first SINKS tokens and the last WINDOW, against a
# context of LONG_CONTEXT tokens kept whole.
SINKS, WINDOW, LONG_CONTEXT = 4, 4096, 32 * 1024
MIB = 2**20

MODELS = ("snippets/models/deepinfer-tiny", "snippets/models/deepinfer-tiny-moe")
POOL_BLOCKS = 8  # the pool's size does not change a block's bytes
# The dtype the tiny checkpoints are saved in: two bytes a number, as bf16, and
# a CPU without bf16 matmuls loads it too (bf16 weights are packed for oneDNN).
POOL_DTYPE = "float16"
PROMPT_IDS = list(range(1, BLOCK_SIZE + 1))  # one full block of token ids

# The run under a window: one greedy request, a small window that bites.
RUN_WINDOW = (4, 2 * BLOCK_SIZE)
RUN_PROMPT = "The block manager keeps a free list of blocks, and"
RUN_TOKENS = 120


def per_token(spec: KVCacheSpec) -> int:
    """Bytes one token takes in one layer of this format, from its spec."""
    total = spec.block_bytes(BLOCK_SIZE)
    assert total % BLOCK_SIZE == 0, "a block's bytes are a whole number per token"
    return total // BLOCK_SIZE


def formats(spec: KVCacheSpec) -> list[int | None]:
    """The spec's bytes per token for each kv_cache_dtype; None where refused."""
    out: list[int | None] = [per_token(spec)]
    for fmt in FORMATS.values():
        try:
            out.append(per_token(spec.quantized(fmt)))
        except ValueError:  # the engine refuses this format on this layer
            out.append(None)
    return out


def published_specs() -> dict[str, KVCacheSpec]:
    latent = MLACacheSpec(DEEPSEEK["kv_lora_rank"], DEEPSEEK["qk_rope_head_dim"], DTYPE)
    return {
        "gqa": FullAttentionSpec(LLAMA["kv_heads"], LLAMA["head_dim"], DTYPE),
        "mha": FullAttentionSpec(LLAMA["heads"], LLAMA["head_dim"], DTYPE),
        "mla": latent,
        "dsa": IndexedLatentSpec(latent, V32["index_head_dim"]),
    }


def show_published(results: dict) -> dict[str, KVCacheSpec]:
    specs = published_specs()
    names = {
        "gqa": LLAMA["name"],
        "mha": "same width",
        "mla": DEEPSEEK["name"],
        "dsa": V32["name"],
    }
    print("KV bytes per token and layer, from the specs:")
    print(f"  block_bytes({BLOCK_SIZE}) / {BLOCK_SIZE}, numbers in bf16")
    print()
    auto, fp8, int8 = KV_DTYPES
    print(f"{'kind':<4} {'shape':<16} {auto:>7} {fp8:>9} {int8:>8}")
    for kind, spec in specs.items():
        cells = formats(spec)
        shown = [f"{c:,}" if c is not None else "refused" for c in cells]
        print(f"{kind.upper():<4} {names[kind]:<16} {shown[0]:>7} {shown[1]:>9} {shown[2]:>8}")
        for dtype, cell in zip(KV_DTYPES, cells):
            if cell is not None:
                results[f"{kind}_{dtype}"] = cell
    dsa = specs["dsa"]
    assert isinstance(dsa, IndexedLatentSpec)
    index = dsa.index_bytes(BLOCK_SIZE) // BLOCK_SIZE
    results["dsa_index_bytes"] = index
    print(f"{'':<4} {'its indexer keys':<16} {index:>7,}")
    print()
    print("shapes (config.json on huggingface.co):")
    for kind, repo in SOURCES:
        print(f"  {kind}  {repo}")
    return specs


def window_bound(sinks: int, window: int, block_size: int) -> int:
    """The most blocks a decoding request holds under kv_window=(sinks, window):
    the sinks' blocks, the window's, and one the window straddles."""
    return cdiv(sinks, block_size) + cdiv(window, block_size) + 1


def show_window(specs: dict[str, KVCacheSpec], results: dict) -> None:
    bound = window_bound(SINKS, WINDOW, BLOCK_SIZE)
    whole = cdiv(LONG_CONTEXT, BLOCK_SIZE)
    gqa = specs["gqa"].block_bytes(BLOCK_SIZE)
    print()
    print(f"kv_window=({SINKS}, {WINDOW:,}), blocks of {BLOCK_SIZE}, decoding:")
    print(f"  at most {bound:,} blocks held, at any length")
    print(f"  a {LONG_CONTEXT:,}-token context, whole: {whole:,} blocks")
    print(f"  GQA, one layer: {bound * gqa / MIB:,.3f} MiB against")
    print(f"    {whole * gqa / MIB:,.3f} MiB for the whole context")
    results.update(
        window_sinks=SINKS,
        window_tokens=WINDOW,
        window_bound=bound,
        long_context=LONG_CONTEXT,
        long_context_blocks=whole,
        window_gqa_mib=bound * gqa / MIB,  # exact: a block's bytes are a multiple of 2**16
        long_context_gqa_mib=whole * gqa / MIB,
    )


def show_pools(results: dict) -> None:
    print()
    print(f"the engine's pool: LLM(..., num_kv_blocks={POOL_BLOCKS})")
    print(f"  pool.block_bytes() / block_size, {POOL_DTYPE}")
    print("  bytes: a token's, all layers; /layer: one layer's")
    print()
    print(f"{'model':<19} {'kv_cache_dtype':<14} {'bytes':>6} {'/layer':>7}")
    roots: list[tuple[str, bytes]] = []
    first: tuple[str, str] | None = None  # deepinfer-tiny's model identity and format
    shapes: list[str] = []
    for path in MODELS:
        name = path.rsplit("/", 1)[-1]
        for dtype in KV_DTYPES:
            llm = LLM(path, dtype=POOL_DTYPE, num_kv_blocks=POOL_BLOCKS, kv_cache_dtype=dtype)
            engine = llm.llm_engine
            pool = engine.executor.model_runner.kv_cache
            token = pool.block_bytes() // pool.block_size
            layer = token // len(pool.specs)
            print(f"{name if dtype == 'auto' else '':<19} {dtype:<14} {token:>6,} {layer:>7,}")
            key = name.removeprefix("deepinfer-").replace("-", "_")
            results[f"pool_{key}_{dtype}"] = token
            results[f"pool_{key}_{dtype}_layer"] = layer
            if dtype == "auto":
                shapes.append(
                    f"{name}: {len(pool.specs)} layers, {shape(pool.specs[0], results, key)}"
                )
                results[f"pool_{key}_layers"] = len(pool.specs)
            cfg = engine.config
            root = chain_root(cfg.model_identity, cfg.kv_format, pool.block_size)
            assert engine.block_manager.root == root, "the engine's root is chain_root's"
            roots.append((f"{name}, {cfg.kv_format}", root))
            first = first or (cfg.model_identity, cfg.kv_format)
            llm.shutdown()
    assert first is not None
    print()
    for line in shapes:
        print(line)
    other = chain_root(*first, 2 * BLOCK_SIZE)
    roots.append((f"{MODELS[0].rsplit('/', 1)[-1]}, {first[1]}, {2 * BLOCK_SIZE} a block", other))
    show_roots(roots, results)


def shape(spec: KVCacheSpec, results: dict, key: str) -> str:
    """A loaded layer's cache shape, from its spec, as a label and as results."""
    if isinstance(spec, FullAttentionSpec):
        results.update(
            {f"pool_{key}_kv_heads": spec.num_kv_heads, f"pool_{key}_head_dim": spec.head_dim}
        )
        return f"{spec.num_kv_heads} KV heads of {spec.head_dim}"
    assert isinstance(spec, MLACacheSpec)
    results.update({f"pool_{key}_latent": spec.kv_lora_rank, f"pool_{key}_rope": spec.rope_dim})
    return f"latent {spec.kv_lora_rank} + rotary key {spec.rope_dim}"


def show_roots(roots: list[tuple[str, bytes]], results: dict) -> None:
    """Each cache's chain root (its first 8 hex digits), and the key one block
    of the same tokens gets under each."""
    print()
    print("the root each cache's hash chains start from,")
    print("  chain_root(model_identity, kv_format, block_size):")
    for label, root in roots:
        print(f"  {root.hex()[:8]}  {label}")
    keys = {chain_hash(root, PROMPT_IDS) for _, root in roots}
    print(f"one block of {len(PROMPT_IDS)} token ids, hashed under each:")
    print(f"  {len(keys)} distinct keys for {len(roots)} roots")
    results["roots"] = len(roots)
    results["distinct_first_block_keys"] = len(keys)


def show_window_run(results: dict) -> None:
    """One request under a small window: the blocks it holds after each step."""
    sinks, window = RUN_WINDOW
    llm = LLM(
        MODELS[0], dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=64, kv_window=RUN_WINDOW
    )
    engine = llm.llm_engine
    engine.add_request("r", RUN_PROMPT, SamplingParams(temperature=0, max_tokens=RUN_TOKENS))
    most, entries, holes = 0, 0, 0  # entries and holes: the table after the last step
    generated = 0
    while engine.has_unfinished_requests():
        generated = next((len(o.token_ids) for o in engine.step() if o.finished), generated)
        seq = engine.requests.get("r")
        if seq is not None and seq.block_table:  # a finished request's table is cleared
            held = sum(1 for b in seq.block_table if b != HOLE)
            most = max(most, held)
            entries, holes = len(seq.block_table), len(seq.block_table) - held
    bound = window_bound(sinks, window, BLOCK_SIZE)
    llm.shutdown()
    print()
    print(f"deepinfer-tiny, kv_window=({sinks}, {window}), blocks of {BLOCK_SIZE}:")
    print(f"  one request, {generated} tokens generated")
    print(f"  most blocks held after a step: {most}; the bound: {bound}")
    print(f"  its block table at its last step: {entries} entries,")
    print(f"    {holes} of them holes")
    results.update(run_sinks=sinks, run_window=window, run_generated=generated)
    results.update(run_most_held=most, run_bound=bound, run_entries=entries, run_holes=holes)


def main() -> dict:
    results: dict = {"block_size": BLOCK_SIZE}
    specs = show_published(results)
    show_window(specs, results)
    show_pools(results)
    show_window_run(results)
    return results


if __name__ == "__main__":
    main()
