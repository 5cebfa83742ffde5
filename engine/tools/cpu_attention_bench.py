"""Decode attention on the CPU: the torch backend's gather-then-SDPA against the
C++ operator that reads blocks in place (engine/csrc/paged_attention.cpp).

    python -m engine.tools.cpu_attention_bench [--repeats 20] [--threads N]

Both sides are first checked against the float64 reference on the same inputs.
Each row times one layer's decode attention for a batch of sequences, with
block tables shuffled over the whole cache; the two sides take turns, and the
fastest of each side's repeats is reported, with their ratio, from the same run.
"""

from __future__ import annotations

import argparse
import time

import torch

from engine import csrc
from engine.attention.metadata import AttentionMetadata, for_decodes
from engine.attention.torch_backend import TorchBackend
from engine.kernels import reference
from engine.kv.kv_cache import PagedKV
from engine.tools.kernel_bench import random_paged_cache, rel_err

BLOCK_SIZE = 16
# (label, query heads, KV heads, head_dim)
SHAPES = [("deepinfer-tiny", 4, 2, 64), ("Qwen3-0.6B", 16, 8, 128)]
BATCHES = (1, 8, 64)
CONTEXT = 512


def best_us(fns, repeats: int) -> list[float]:
    """Each function's fastest run, in microseconds. The functions take turns, so
    a busy neighbour on a shared machine slows every side alike, and the fastest
    run is the one it disturbed least."""
    for fn in fns:
        fn()  # warm up: allocations, first touch of the buffers
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return [t * 1e6 for t in best]


def decode_only_metadata(tables: torch.Tensor, lens: list[int]) -> AttentionMetadata:
    """A step in which every sequence decodes one token over its cached context."""
    slots, context_lens = (
        torch.zeros(len(lens), dtype=torch.long),
        torch.tensor(lens, dtype=torch.int32),
    )
    return for_decodes(slots, tables, context_lens, lens)


def one_row(shape, batch: int, dtype: torch.dtype, repeats: int) -> tuple[float, float, float]:
    _, heads, kv_heads, head_dim = shape
    lens = [CONTEXT] * batch
    k, v, tables = random_paged_cache(lens, kv_heads, head_dim, BLOCK_SIZE, dtype, "cpu")
    q = torch.randn(batch, heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    meta = decode_only_metadata(tables, lens)
    ctx = meta.context_lens
    backend = TorchBackend(BLOCK_SIZE)
    torch_meta = backend.build_metadata(meta)  # once per step, shared by every layer

    def torch_path():
        return backend.forward(q, None, None, PagedKV(k, v), torch_meta, scale)

    def cpp_op():
        return torch.ops.deepinfer.paged_decode_attention(q, k, v, tables, ctx, scale)

    ref = reference.paged_decode_attention(q, k, v, tables, ctx, scale)
    err = max(rel_err(torch_path(), ref), rel_err(cpp_op(), ref))
    t_torch, t_cpp = best_us([torch_path, cpp_op], repeats)
    return t_torch, t_cpp, err


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not csrc.load():
        print("the C++ operators could not be built here; nothing to compare")
        return 1
    torch.manual_seed(0)
    print(
        f"decode attention, one layer, {CONTEXT} cached tokens per sequence, "
        f"blocks of {BLOCK_SIZE}, threads: {torch.get_num_threads()}; best of {args.repeats}"
    )
    header = f"{'model shape':<16}{'dtype':<10}{'batch':>6}{'torch µs':>11}{'C++ µs':>10}"
    print(header + f"{'speed-up':>10}{'max rel err':>13}")
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for batch in BATCHES:
                t_torch, t_cpp, err = one_row(shape, batch, dtype, args.repeats)
                name = str(dtype).removeprefix("torch.")
                print(
                    f"{shape[0]:<16}{name:<10}{batch:>6}{t_torch:>11.0f}{t_cpp:>10.0f}"
                    f"{t_torch / t_cpp:>9.2f}x{err:>13.1e}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
