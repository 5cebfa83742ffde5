"""How fast are the kernels, against what this GPU can do at best?

    python -m engine.tools.kernel_bench                  a CUDA GPU; under 8 minutes on an H200
    python -m engine.tools.kernel_bench --selftest-cpu   the correctness checks alone, tiny, on the
                                                    CPU in Triton's interpreter

First every kernel is checked against the float64 references on random inputs
(a fast wrong kernel is not worth timing). Then two tables, each against a
ceiling measured on the same device rather than a datasheet number:

* decode attention is a stream over the KV cache, so its yardstick is memory
  bandwidth: bytes of K and V read per second, as a fraction of a large
  device-to-device copy (bytes read plus bytes written);
* prefill attention is matrix products, so its yardstick is arithmetic:
  causal attention FLOP/s, as a fraction of a large bfloat16 torch.matmul.

A third table times the FP8 GEMM (DeepGEMM's scheme, engine/kernels/fp8_gemm.py)
on DeepSeek-V3's linear shapes against what an FP8 layer would do without it:
dequantize the whole weight to bfloat16, then torch's matmul.

Each timing replays a CUDA graph of one call (no Python launch overhead) after
flushing the L2 cache, and reports the median; inputs are random, never zeros,
and block tables are shuffled over the whole cache.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial

import torch

from engine.kernels import reference
from engine.kernels.availability import compiled_kernel_modules, interpreter_active
from engine.utils import cdiv

# Llama-3-8B's attention shape: 32 query heads, 8 kv heads, head_dim 128.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_CONTEXTS = (1024, 4096, 16384, 32768)
# (label, [(cached prefix, new tokens)] per sequence)
PREFILL_CASES = [
    ("1 x 512", [(0, 512)]),
    ("1 x 2048", [(0, 2048)]),
    ("1 x 8192", [(0, 8192)]),
    ("1 x 16384", [(0, 16384)]),
    ("8 x 1024", [(0, 1024)] * 8),
    ("32 x 256", [(0, 256)] * 32),
    ("chunk 2048 after 14336", [(14336, 2048)]),
    ("4 x 512 after prefix 3584", [(3584, 512)] * 4),
]
# Relative error ||out - ref|| / ||ref|| allowed against float64. bfloat16 is
# looser than one rounding (3.9e-3) because the interpreter truncates to it.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
# On a GPU the FP8 GEMM sums each 128-product block on FP8 tensor cores, whose
# accumulation keeps about 14 bits (DeepSeek-V3 technical report, arXiv:2412.19437,
# section 3.3.2), not float32's 24; that is why the scheme promotes every 128. So a
# float32 result is held to 2^-12 there (an estimate, to be confirmed on the GPU).
GPU_TOLERANCE = {"fp8_gemm": 2.0**-12}


# ---------------------------------------------------------------------------- random inputs


def random_paged_cache(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    spare_blocks: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables whose blocks are shuffled over the whole cache."""
    needed = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(needed) + spare_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    order = torch.randperm(num_blocks, device=device).int()
    block_tables = torch.full((len(context_lens), max(needed)), -1, dtype=torch.int32)
    start = 0
    for i, count in enumerate(needed):
        block_tables[i, :count] = order[start : start + count].cpu()
        start += count
    return k_cache, v_cache, block_tables.to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


# ---------------------------------------------------------------------------- correctness


def check_store_kvcache(device: str, dtype: torch.dtype, tiny: bool) -> float:
    """0.0 when every stored slot equals its input exactly and no other slot changed."""
    from engine.kernels import store_kvcache

    num_tokens, num_blocks = (20, 4) if tiny else (4096, 1024)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=device)
    v_cache = torch.randn(shape, dtype=dtype, device=device)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    v = torch.randn_like(k)
    slot_mapping = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:num_tokens]
    slot_mapping[::5] = -1
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    stored = slot_mapping >= 0
    before_k.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping[stored]] = k[stored]
    before_v.view(-1, NUM_KV_HEADS, HEAD_DIM)[slot_mapping[stored]] = v[stored]
    exact = torch.equal(k_cache, before_k) and torch.equal(v_cache, before_v)
    return 0.0 if exact else 1.0


def check_decode_attention(device: str, dtype: torch.dtype, tiny: bool) -> float:
    from engine.kernels import paged_decode_attention

    lens = [1, 300, 600] if tiny else [1, 255, 256, 257, 1000, 4097, 9000, 20000]
    heads, kv_heads, head_dim = (4, 2, 64) if tiny else (NUM_HEADS, NUM_KV_HEADS, HEAD_DIM)
    k_cache, v_cache, tables = random_paged_cache(
        lens, kv_heads, head_dim, BLOCK_SIZE, dtype, device, 3
    )
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, head_dim**-0.5)
    ref = reference.paged_decode_attention(
        q, k_cache, v_cache, tables, context_lens, head_dim**-0.5
    )
    return rel_err(out, ref)


def check_prefill_attention(device: str, dtype: torch.dtype, tiny: bool) -> float:
    from engine.kernels import paged_prefill_attention

    if tiny:  # (context, new tokens): a prefill, a chunk after a prefix, one token
        seqs, heads, kv_heads, head_dim = [(70, 70), (150, 40), (33, 1)], 4, 2, 64
    else:
        seqs = [(1000, 1000), (3000, 512), (4096, 1), (2048, 2048), (777, 100)]
        heads, kv_heads, head_dim = NUM_HEADS, NUM_KV_HEADS, HEAD_DIM
    lens = [context for context, _ in seqs]
    k_cache, v_cache, tables = random_paged_cache(
        lens, kv_heads, head_dim, BLOCK_SIZE, dtype, device, 3
    )
    query_lens = [new for _, new in seqs]
    cu_seqlens_q = torch.tensor([0, *query_lens], device=device).cumsum(0).int()
    q = torch.randn(sum(query_lens), heads, head_dim, dtype=dtype, device=device)
    context_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    scale = head_dim**-0.5
    out = paged_prefill_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale)
    ref = reference.paged_attention(q, k_cache, v_cache, tables, cu_seqlens_q, context_lens, scale)
    return rel_err(out, ref)


def check_rms_norm(device: str, dtype: torch.dtype, tiny: bool) -> float:
    from engine.kernels import fused_add_rms_norm, rms_norm

    rows, hidden = (5, 1000) if tiny else (1000, 4096)
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = 1 + 0.1 * torch.randn(hidden, dtype=dtype, device=device)
    plain = rel_err(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))
    out, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
    fused = rel_err(out, reference.rms_norm(x.double() + residual.double(), weight, 1e-6))
    return max(plain, fused, rel_err(summed, x.double() + residual.double()))


def check_rotary_embedding(device: str, dtype: torch.dtype, tiny: bool) -> float:
    from engine.kernels import rotary_embedding

    tokens, heads, kv_heads, head_dim = (7, 4, 2, 64) if tiny else (2048, 32, 8, 128)
    angles = torch.rand(8192, head_dim // 2, device=device) * 100
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, 8192, (tokens,), device=device)
    q = torch.randn(tokens, heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(tokens, kv_heads, head_dim, dtype=dtype, device=device)
    q_out, k_out = rotary_embedding(positions, q, k, cos_sin_cache)
    return max(
        rel_err(q_out, reference.rotary_embedding(positions, q, cos_sin_cache)),
        rel_err(k_out, reference.rotary_embedding(positions, k, cos_sin_cache)),
    )


def random_fp8_weight(
    rows: int, cols: int, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 E4M3 codes [rows, cols] over most of E4M3's range, and one float32 scale per
    128 x 128 block, repeated down its rows (Fp8Linear's layout)."""
    from engine.layers.quantization.fp8 import expand_block_scales

    q = (torch.randn(rows, cols, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    blocks = (torch.rand(cdiv(rows, 128), cdiv(cols, 128), device=device) + 0.5) * 2.0**-12
    return q, expand_block_scales(blocks, rows)


def check_fp8_gemm(device: str, dtype: torch.dtype, tiny: bool) -> float:
    from engine.kernels import fp8_gemm

    tokens, rows, cols = (3, 130, 200) if tiny else (100, 2112, 7168)
    q, row_scales = random_fp8_weight(rows, cols, device)
    x = torch.randn(tokens, cols, dtype=dtype, device=device)
    bias = torch.randn(rows, dtype=dtype, device=device)
    out = fp8_gemm(x, q, row_scales, bias)
    return rel_err(out, reference.fp8_gemm(x, q, row_scales, bias))


CHECKS: dict[str, Callable[[str, torch.dtype, bool], float]] = {
    "store_kvcache": check_store_kvcache,
    "paged_decode_attention": check_decode_attention,
    "paged_prefill_attention": check_prefill_attention,
    "rms_norm + fused_add_rms_norm": check_rms_norm,
    "rotary_embedding": check_rotary_embedding,
    "fp8_gemm": check_fp8_gemm,
}


def run_checks(device: str, dtypes: tuple[torch.dtype, ...], tiny: bool) -> bool:
    """Print each kernel's relative error against float64; True when all are within tolerance."""
    print(f"{'kernel':32} {'dtype':>9} {'rel. error':>11} {'tolerance':>10}")
    ok = True
    for name, check in CHECKS.items():
        for dtype in dtypes:
            err = check(device, dtype, tiny)
            tolerance = TOLERANCE[dtype]
            if device != "cpu":
                tolerance = max(tolerance, GPU_TOLERANCE.get(name, 0.0))
            passed = err <= tolerance
            ok &= passed
            dtype_name = str(dtype).removeprefix("torch.")
            flag = "" if passed else "  FAILED"
            print(f"{name:32} {dtype_name:>9} {err:11.2e} {tolerance:10.0e}{flag}")
    return ok


# ---------------------------------------------------------------------------- timing (CUDA)


def time_ms(fn: Callable[[], object], budget_ms: float = 150.0) -> float:
    """Median GPU time of one call: a CUDA graph of fn, replayed after an L2 flush each time."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile, and warm the allocator, outside the capture
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")  # more than L2 holds

    def replay(times: int) -> list[float]:
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(times)
        ]
        for start, end in events:
            flush.zero_()  # also gives the CPU a head start, so no launch gap is timed
            start.record()
            graph.replay()
            end.record()
        torch.cuda.synchronize()
        return [start.elapsed_time(end) for start, end in events]

    estimate = statistics.median(replay(3))
    return statistics.median(replay(max(5, min(200, int(budget_ms / max(estimate, 1e-3))))))


def copy_bandwidth() -> float:
    """Bytes per second of a 2 GiB device-to-device copy, counting reads and writes."""
    src = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    seconds = time_ms(lambda: dst.copy_(src)) / 1e3
    return 2 * src.numel() * src.element_size() / seconds


def matmul_flops() -> float:
    """FLOP/s of torch.matmul on random 8192 x 8192 bfloat16 matrices."""
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    return 2 * n**3 / (time_ms(lambda: torch.matmul(a, b)) / 1e3)


def decode_table(copy_bytes_per_s: float) -> None:
    from engine.kernels import paged_decode_attention

    dtype = torch.bfloat16
    max_tokens = max(DECODE_BATCHES) * max(DECODE_CONTEXTS)
    num_blocks = max_tokens // BLOCK_SIZE
    # One cache for every row, big enough for the largest; each row scatters
    # its sequences' blocks over all of it.
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device="cuda")
    v_cache = torch.randn(shape, dtype=dtype, device="cuda")
    scale = HEAD_DIM**-0.5
    print(f"\nDecode attention, bf16, {NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}")
    print(f"{'batch':>6} {'context':>8} {'time us':>9} {'GB/s':>8} {'of copy':>8}")
    for batch in DECODE_BATCHES:
        for context in DECODE_CONTEXTS:
            blocks_per_seq = context // BLOCK_SIZE
            order = torch.randperm(num_blocks, device="cuda")[: batch * blocks_per_seq]
            tables = order.view(batch, blocks_per_seq).int()
            context_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
            out = torch.empty_like(q)
            call = partial(
                paged_decode_attention, q, k_cache, v_cache, tables, context_lens, scale, out=out
            )
            ms = time_ms(call)
            kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * k_cache.element_size()
            io_bytes = kv_bytes + 2 * q.numel() * q.element_size()  # plus q read and out written
            bytes_per_s = io_bytes / (ms / 1e3)
            print(
                f"{batch:6d} {context:8d} {ms * 1e3:9.1f} {bytes_per_s / 1e9:8.0f} "
                f"{bytes_per_s / copy_bytes_per_s:8.0%}"
            )
    del k_cache, v_cache
    torch.cuda.empty_cache()


def prefill_table(matmul_flop_per_s: float) -> None:
    from engine.kernels import paged_prefill_attention

    dtype = torch.bfloat16
    scale = HEAD_DIM**-0.5
    print(
        f"\nPrefill attention, bf16, causal, {NUM_HEADS}/{NUM_KV_HEADS} heads, head_dim {HEAD_DIM}"
    )
    print(f"{'sequences':>26} {'time us':>9} {'TFLOP/s':>8} {'of matmul':>9}")
    for label, seqs in PREFILL_CASES:
        lens = [prefix + new for prefix, new in seqs]
        k_cache, v_cache, tables = random_paged_cache(
            lens, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, dtype, "cuda", spare_blocks=64
        )
        query_lens = [new for _, new in seqs]
        cu_seqlens_q = torch.tensor([0, *query_lens], device="cuda").cumsum(0).int()
        context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
        q = torch.randn(sum(query_lens), NUM_HEADS, HEAD_DIM, dtype=dtype, device="cuda")
        out = torch.empty_like(q)
        call = partial(
            paged_prefill_attention,
            q,
            k_cache,
            v_cache,
            tables,
            cu_seqlens_q,
            context_lens,
            scale,
            out=out,
            max_seqlen_q=max(query_lens),  # no .item() sync, so the call can be captured
        )
        ms = time_ms(call)
        # Query i of a sequence with prefix p sees p + i + 1 keys; each (query, key)
        # pair costs 2 * head_dim FLOPs for q.k and as many for p.v, per head.
        pairs = sum(new * prefix + new * (new + 1) // 2 for prefix, new in seqs)
        flop_per_s = 4 * pairs * HEAD_DIM * NUM_HEADS / (ms / 1e3)
        print(
            f"{label:>26} {ms * 1e3:9.1f} {flop_per_s / 1e12:8.1f} "
            f"{flop_per_s / matmul_flop_per_s:9.0%}"
        )


# DeepSeek-V3's FP8 linear layers (config.json: hidden 7168, q_lora_rank 1536,
# kv_lora_rank 512 + rope 64, 128 heads, intermediate 18432): (rows, cols).
FP8_SHAPES = [(2112, 7168), (24576, 1536), (7168, 16384), (36864, 7168), (7168, 18432)]
FP8_TOKENS = (1, 16, 128, 1024, 4096)


def dequantize_matmul(x: torch.Tensor, q: torch.Tensor, row_scales: torch.Tensor) -> torch.Tensor:
    """An FP8 layer without the FP8 GEMM: the whole weight dequantized to x's dtype, then matmul."""
    from engine.layers.quantization.fp8 import dequantize_torch

    return torch.nn.functional.linear(x, dequantize_torch(q, row_scales, x.dtype))


def fp8_gemm_table(matmul_flop_per_s: float) -> None:
    """The FP8 GEMM against dequantize_matmul, bfloat16 activations, DeepSeek-V3's shapes."""
    from engine.kernels import fp8_gemm

    print("\nFP8 GEMM (1 x 128 activation, 128 x 128 weight scales), bf16 activations")
    print(
        f"{'rows x cols':>14} {'tokens':>7} {'time us':>9} {'TFLOP/s':>8} {'of matmul':>9} "
        f"{'deq+mm us':>10} {'speedup':>8}"
    )
    for rows, cols in FP8_SHAPES:
        q, row_scales = random_fp8_weight(rows, cols, "cuda")
        for tokens in FP8_TOKENS:
            x = torch.randn(tokens, cols, dtype=torch.bfloat16, device="cuda")
            ours = time_ms(partial(fp8_gemm, x, q, row_scales, None))
            theirs = time_ms(partial(dequantize_matmul, x, q, row_scales))
            flop_per_s = 2 * tokens * rows * cols / (ours / 1e3)
            print(
                f"{f'{rows} x {cols}':>14} {tokens:7d} {ours * 1e3:9.1f} "
                f"{flop_per_s / 1e12:8.1f} {flop_per_s / matmul_flop_per_s:9.0%} "
                f"{theirs * 1e3:10.1f} {theirs / ours:7.2f}x"
            )
        del q, row_scales
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- entry point


# Qwen3-0.6B's published shape (Hugging Face Qwen/Qwen3-0.6B config.json).
QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    rms_norm_eps=1e-6,
)


def end_to_end(
    num_requests: int = 256, input_len: tuple[int, int] = (128, 512), output_len: int = 128
) -> None:
    """The whole engine against transformers' padded batched generate, on one
    random-weight Qwen3-0.6B-shaped model, in the same run."""
    import tempfile

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from engine.llm import LLM
    from engine.tools.bench import random_prompts, run_engine, run_transformers, warm_up

    with tempfile.TemporaryDirectory() as folder:
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**QWEN3_0_6B)).to(torch.bfloat16)
        model.save_pretrained(folder)
        del model
        prompts = random_prompts(num_requests, *input_len, QWEN3_0_6B["vocab_size"], seed=0)
        llm = LLM(folder, max_num_seqs=num_requests, max_model_len=input_len[1] + output_len + 16)
        warm_up(llm, random_prompts(2, *input_len, QWEN3_0_6B["vocab_size"], seed=1))
        ours = run_engine(llm, prompts, output_len)
        del llm
        torch.cuda.empty_cache()
        theirs = run_transformers(folder, prompts, output_len, "cuda", torch.bfloat16)
    print(
        f"\nEnd to end, Qwen3-0.6B shape, random bf16 weights: {num_requests} requests, "
        f"input {input_len[0]}-{input_len[1]} tokens, {output_len} output tokens"
    )
    print(f"{'':28}{'engine':>10}{'transformers':>14}")
    print(f"{'output tokens/s':28}{ours.tokens_per_s:10.0f}{theirs.tokens_per_s:14.0f}")
    print(f"{'total seconds':28}{ours.seconds:10.2f}{theirs.seconds:14.2f}")
    print(f"engine / transformers: {ours.tokens_per_s / theirs.tokens_per_s:.2f}x")


def selftest_cpu() -> int:
    if not interpreter_active() or compiled_kernel_modules():
        # Triton decides between interpreter and compiler when it is imported,
        # which `python -m engine.tools.kernel_bench` already did: start afresh.
        env = dict(os.environ, TRITON_INTERPRET="1")
        argv = [sys.executable, "-m", "engine.tools.kernel_bench", "--selftest-cpu"]
        os.execve(sys.executable, argv, env)
    seed = time.time_ns() % 2**31
    torch.manual_seed(seed)
    print(f"seed {seed}")
    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    ok = run_checks("cpu", dtypes, tiny=True)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.tools.kernel_bench", description=__doc__
    )
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument(
        "--selftest-cpu",
        action="store_true",
        help="run only the correctness checks, at tiny sizes, on the CPU under TRITON_INTERPRET=1",
    )
    parser.add_argument(
        "--kernels-only", action="store_true", help="skip the end-to-end engine comparison"
    )
    args = parser.parse_args(argv)
    if args.selftest_cpu:
        return selftest_cpu()
    if not torch.cuda.is_available():
        print(
            "engine.tools.kernel_bench times the kernels on a CUDA GPU and found none; "
            "`--selftest-cpu` runs its correctness checks on the CPU.",
            file=sys.stderr,
        )
        return 2
    if interpreter_active():
        print("unset TRITON_INTERPRET: timing the interpreter measures nothing", file=sys.stderr)
        return 2

    import triton

    started = time.perf_counter()
    seed = time.time_ns() % 2**31
    torch.manual_seed(seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print(f"seed {seed}")
    print("\nCorrectness against float64 on random inputs")
    if not run_checks("cuda", (torch.bfloat16, torch.float16), tiny=False):
        print("\nsome kernels are wrong; not timing them", file=sys.stderr)
        return 1

    copy_bytes_per_s = copy_bandwidth()
    matmul_flop_per_s = matmul_flops()
    print(f"\ndevice-to-device copy: {copy_bytes_per_s / 1e9:.0f} GB/s (read + write)")
    print(f"bf16 matmul 8192^3: {matmul_flop_per_s / 1e12:.0f} TFLOP/s")
    decode_table(copy_bytes_per_s)
    prefill_table(matmul_flop_per_s)
    fp8_gemm_table(matmul_flop_per_s)
    if not args.kernels_only:
        end_to_end()
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
