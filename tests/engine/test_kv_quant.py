"""The quantized KV cache (engine/kv/quant.py): FP8 E4M3 and int8 codes with a
float32 scale per token and KV head (per 128 latent numbers for MLA).

On fresh random inputs each run (KV_QUANT_SEED=<seed> replays one):
- a round trip moves no number more than its format's bound, against float64;
- an all-zero group gets a finite, non-zero scale and reads back as zeros;
- the C++ operator on a quantized cache equals float64 attention over the
  numbers the codes stand for, and every backend's attention over a quantized
  cache stays within a stated distance of the exact cache's;
- the pool sizes, zeroes, exports and imports the codes with their scales;
- a quantized engine's greedy tokens are the same alone, chunked, preempted and
  from the prefix cache, since attention always reads what the cache stores.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from engine import LLM, SamplingParams, csrc
from engine.attention.torch_backend import TorchBackend
from engine.config import EngineConfig
from engine.config.kv_format import FORMATS, quant_format
from engine.kernels import reference
from engine.kv.kv_cache import FullAttentionSpec, MLACacheSpec, PagedKV, store_kvcache
from engine.kv.quant import dequantize, error_bound, quantize
from engine.tools.cpu_attention_bench import decode_only_metadata
from engine.tools.kernel_bench import random_paged_cache, rel_err
from tests.conftest import ROOT

SEED = int(os.environ.get("KV_QUANT_SEED", random.randrange(2**31)))
TINY = str(ROOT / "snippets" / "models" / "deepinfer-tiny")
TINY_MOE = str(ROOT / "snippets" / "models" / "deepinfer-tiny-moe")
# Relative distance ||quantized - exact|| / ||exact|| allowed for one attention
# output over random unit-normal keys and values. FP8's 3 mantissa bits err by up
# to 1/16 of a number, about 2-3% on average; int8's 127 steps by 1/254 of a row's
# largest magnitude. Observed: about 0.02 and 0.004.
ATTENTION_TOLERANCE = {"fp8_e4m3": 0.05, "int8": 0.01}
FORMAT_NAMES = list(FORMATS)


def samples(shape: tuple[int, ...]) -> torch.Tensor:
    """Random rows with what real keys have: outlier channels, tiny rows, a zero row."""
    x = torch.randn(shape, dtype=torch.float64)
    x[..., 3] *= 40.0  # an outlier channel
    x[1] *= 1e-6  # a tiny row: its own scale makes it as precise as any other
    x[2] = 0.0
    x[3, ..., : shape[-1] // 2] *= 1e-4  # small numbers beside large ones: subnormal codes
    return x


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("group", [16, 64, 128])
def test_a_round_trip_stays_within_the_formats_bound(name: str, group: int) -> None:
    torch.manual_seed(SEED)
    fmt = FORMATS[name]
    x = samples((6, 5, 256)).float()
    codes, scales = quantize(x, fmt, group)
    assert codes.dtype == fmt.storage and scales.shape == (6, 5, 256 // group)
    back = dequantize(codes, scales, torch.float64)
    moved = (back - x.double()).abs()
    # quantize divides by the scale in float32, which rounds x / scale by up to 2^-24
    # of itself before the code is chosen: a number that lands that close to a
    # midpoint may take the farther code, by up to |x| 2^-24 more than the format's
    # bound (2^-23 here, for the scale's own rounding too).
    bound = error_bound(x, scales, fmt) + x.double().abs() * 2.0**-23 + 1e-37
    worst = (moved / bound).max().item()
    assert worst <= 1.0, f"{name}: a number moved {worst:.3f}x its bound; seed={SEED}"


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_an_all_zero_group_has_a_finite_nonzero_scale_and_reads_back_as_zeros(
    name: str,
) -> None:
    fmt = FORMATS[name]
    codes, scales = quantize(torch.zeros(4, 2, 64), fmt, group=64)
    assert torch.isfinite(scales).all() and (scales > 0).all()
    back = dequantize(codes, scales, torch.float32)
    assert torch.equal(back, torch.zeros_like(back))


def test_the_largest_number_of_a_group_is_exact() -> None:
    """The scale maps a group's largest magnitude onto the largest code."""
    x = torch.randn(8, 128) * 3
    for fmt in FORMATS.values():
        codes, scales = quantize(x, fmt, group=128)
        back = dequantize(codes, scales, torch.float64)
        top = x.abs().argmax(dim=-1)
        got, want = back.gather(1, top[:, None]), x.double().gather(1, top[:, None])
        assert torch.allclose(got, want, rtol=1e-6), fmt.name


def test_an_unknown_kv_cache_dtype_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8_e4m3, int8"):
        quant_format("fp4")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(TINY, kv_cache_dtype="float8")


def test_combinations_that_cannot_run_are_refused_at_construction() -> None:
    with pytest.raises(ValueError, match="batch_invariant"):
        EngineConfig(TINY, kv_cache_dtype="fp8_e4m3", batch_invariant=True)
    with pytest.raises(ValueError, match="Triton MLA decode"):
        EngineConfig(TINY_MOE, kv_cache_dtype="int8", attention_backend="triton")


def test_a_quantized_cache_names_its_own_hash_chains() -> None:
    """Blocks computed with one format are never a prefix hit for another."""
    auto = EngineConfig(TINY, dtype="float32")
    fp8 = EngineConfig(TINY, dtype="float32", kv_cache_dtype="fp8_e4m3")
    assert auto.kv_format != fp8.kv_format


def test_bytes_per_token_of_each_layout() -> None:
    """One byte a number, plus the scales. For DeepSeek-V3's MLA (latent 512, rotary
    key 64, bf16) the quantized latent is FlashMLA's FP8 layout: 656 bytes a token."""
    fp8 = FORMATS["fp8_e4m3"]
    dense = FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert dense.block_bytes(1) == 2 * 8 * 128 * 2
    assert dense.quantized(fp8).block_bytes(1) == 2 * 8 * (128 + 4)
    mla = MLACacheSpec(kv_lora_rank=512, rope_dim=64, dtype=torch.bfloat16)
    assert mla.block_bytes(1) == (512 + 64) * 2
    assert mla.quantized(fp8).block_bytes(1) == 512 + 4 * 4 + 64 * 2 == 656
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLACacheSpec(kv_lora_rank=200, rope_dim=64, dtype=torch.bfloat16).quantized(fp8)


def quantized_copy(k: torch.Tensor, v: torch.Tensor, name: str) -> PagedKV:
    """A quantized cache holding k and v [blocks, block_size, kv_heads, dim], written
    slot by slot through store_kvcache, as the engine writes it."""
    blocks, bs, heads, dim = k.shape
    spec = FullAttentionSpec(heads, dim, k.dtype).quantized(FORMATS[name])
    cache = spec.allocate(blocks, bs, torch.device("cpu"))
    slots = torch.arange(blocks * bs)
    flat = (-1, heads, dim)
    store_kvcache(k.reshape(flat).nan_to_num(0.0), v.reshape(flat).nan_to_num(0.0), cache, slots)
    return cache


def numbers(cache: PagedKV, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    assert cache.k_scale is not None and cache.v_scale is not None
    k = dequantize(cache.k, cache.k_scale[..., None], dtype)
    v = dequantize(cache.v, cache.v_scale[..., None], dtype)
    return k, v


@pytest.mark.skipif(not csrc.load(), reason="no C++ compiler to build engine/csrc")
@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 2, 64), (4, 4, 128), (4, 1, 32)])
def test_the_cpu_operator_attends_over_the_numbers_the_codes_stand_for(
    name: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    gen = random.Random(SEED)
    torch.manual_seed(SEED)
    block_size = gen.choice([1, 16])
    lens = [gen.randint(1, 200) for _ in range(gen.randint(1, 5))] + [1, block_size + 1]
    k, v, tables = random_paged_cache(lens, kv_heads, head_dim, block_size, dtype, "cpu", 3)
    cache = quantized_copy(k, v, name)
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    out = torch.ops.deepinfer.paged_decode_attention(
        q, cache.k, cache.v, tables, ctx, scale, cache.k_scale, cache.v_scale
    )
    k64, v64 = numbers(cache, torch.float64)
    ref = reference.paged_decode_attention(q.double(), k64, v64, tables, ctx, scale)
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    err = rel_err(out, ref)
    assert err <= tolerance, f"{name} {dtype}: relative error {err:.3g}; seed={SEED}"


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_attention_over_a_quantized_cache_stays_near_the_exact_cache(
    name: str, backend: str
) -> None:
    if backend == "cpu" and not csrc.load():
        pytest.skip("no C++ compiler to build engine/csrc")
    from engine.attention.cpu_backend import CpuBackend

    gen = random.Random(SEED)
    torch.manual_seed(SEED)
    heads, kv_heads, head_dim, block_size = 8, 2, 64, 16
    lens = [gen.randint(16, 300) for _ in range(6)]
    k, v, tables = random_paged_cache(lens, kv_heads, head_dim, block_size, torch.float32, "cpu", 3)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    q = torch.randn(len(lens), heads, head_dim)
    attn = (TorchBackend if backend == "torch" else CpuBackend)(block_size)
    meta = attn.build_metadata(decode_only_metadata(tables, lens))
    scale = head_dim**-0.5
    exact = attn.forward(q, None, None, PagedKV(k, v), meta, scale)
    approx = attn.forward(q, None, None, quantized_copy(k, v, name), meta, scale)
    err = rel_err(approx, exact.double())
    assert 0 < err <= ATTENTION_TOLERANCE[name], f"{name} on {backend}: {err:.4f}; seed={SEED}"


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("model", [TINY, TINY_MOE], ids=["dense", "mla"])
def test_blocks_move_between_pools_with_their_scales(name: str, model: str) -> None:
    llm = LLM(model, dtype="float32", kv_cache_dtype=name, num_kv_blocks=24, block_size=8)
    pool = llm.llm_engine.executor.model_runner.kv_cache
    per_layer = {TINY: 4, TINY_MOE: 3}[model]  # k, v, two scales; or codes, scales, rope
    assert all(len(c.tensors()) == per_layer for c in pool._caches())
    prompt = list(range(40, 80))
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    data = pool.read_blocks([0, 1, 2])
    assert data.nbytes() == 3 * pool.block_bytes()
    pool.write_blocks([10, 11, 12], data)
    again = pool.read_blocks([10, 11, 12])
    for ours, theirs in zip(again.layers, data.layers):
        for a, b in zip(ours, theirs):
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    scales = [t for c in pool._caches() for t in c.tensors() if t.dtype == torch.float32]
    written = [s[:3] for s in scales]
    assert all(torch.isfinite(s).all() and (s > 0).any() for s in written)


@pytest.mark.parametrize("name", FORMAT_NAMES)
@pytest.mark.parametrize("model", [TINY, TINY_MOE], ids=["dense", "mla"])
def test_a_quantized_engine_gives_the_same_tokens_alone_chunked_preempted_and_cached(
    name: str, model: str
) -> None:
    gen = random.Random(SEED)
    prompts = [[gen.randrange(4, 4000) for _ in range(gen.randint(20, 60))] for _ in range(4)]
    prompts.append(prompts[0][:40] + [7, 8, 9])  # shares whole blocks with the first
    params = SamplingParams(temperature=0, max_tokens=24)
    common = dict(dtype="float32", kv_cache_dtype=name, block_size=8)
    alone = []
    for p in prompts:
        llm = LLM(model, **common, enable_prefix_caching=False)
        alone += [o.token_ids for o in llm.generate([p], params, use_tqdm=False)]
    # Chunks of 16 tokens, and a cache too small for all five at once.
    crowded = LLM(model, **common, num_kv_blocks=14, max_num_batched_tokens=16)
    outs = crowded.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == alone, f"{name}; seed={SEED}"
    assert crowded.llm_engine.stats.preemptions > 0
    # The last prompt after the first, from the blocks the first left in the prefix cache.
    cached = LLM(model, **common, max_num_batched_tokens=16)
    first = cached.generate(prompts[:1], params, use_tqdm=False)[0].token_ids
    last = cached.generate(prompts[-1:], params, use_tqdm=False)[0].token_ids
    assert [first, last] == [alone[0], alone[-1]], f"{name}; seed={SEED}"
    assert cached.llm_engine.stats.prefix_cache_hit_tokens > 0


def test_a_wide_kv_window_on_a_quantized_cache_changes_nothing() -> None:
    prompts = [list(range(30, 90)), list(range(200, 230))]
    params = SamplingParams(temperature=0, max_tokens=16)
    common = dict(dtype="float32", kv_cache_dtype="int8", block_size=8)
    plain = LLM(TINY, **common).generate(prompts, params, use_tqdm=False)
    wide = LLM(TINY, **common, kv_window=(8, 512)).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in wide] == [o.token_ids for o in plain]
