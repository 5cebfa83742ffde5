"""The Triton kernels against float64 torch references, on the CPU in Triton's interpreter.

How Triton 3.9 reads TRITON_INTERPRET: `@triton.jit` asks
`triton.knobs.runtime.interpret` (which reads the environment each time,
unless a program assigned the knob) when it *decorates* a function, and builds
an interpreted or a compiled function for good. Triton's own library (tl.sum,
tl.max, tl.cdiv, ...) is decorated when `triton` is imported, the kernels when
`engine.kernels` is. So this module sets the variable before importing either,
and if this process imported them earlier without it (another test module, a
plugin), drops them from sys.modules and imports them again; re-importing
engine.kernels alone is not enough, since the interpreter cannot call a
compiled tl.sum. A subprocess test below checks exactly that.

Every test draws fresh random inputs; the seed is in each failure message, and
KERNELS_SEED=<seed> replays it. Output buffers are poisoned with NaN, and so
are the cache slots no sequence owns, so an element left unwritten, or a read
outside a sequence's blocks, fails the comparison.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from engine.kernels.availability import compiled_kernel_modules, interpreter_active  # noqa: E402

if compiled_kernel_modules() or not triton.knobs.runtime.interpret:
    # Triton (or engine.kernels) was imported in this process before the variable
    # was set, or the knob was assigned False: import them again, so that every
    # @triton.jit runs anew under the interpreter. Triton's C extension stays.
    for _name in [
        n
        for n in sys.modules
        if n.startswith(("triton.", "engine.kernels."))
        and not n.startswith("triton._C")
        or n in ("triton", "engine.kernels")
    ]:
        del sys.modules[_name]

from engine.kernels import (  # noqa: E402
    check_available,
    fused_add_rms_norm,
    paged_decode_attention,
    paged_mla_decode,
    paged_prefill_attention,
    reference,
    rms_norm,
    rotary_embedding,
    store_kvcache,
)
from engine.kernels.decode_attention import KV_SPLIT_SIZE  # noqa: E402
from engine.kernels.prefill_attention import BLOCK_M  # noqa: E402
from engine.utils import cdiv  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

pytestmark = pytest.mark.triton

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# Relative error ||out - ref|| / ||ref|| allowed against float64, for every
# kernel. float32: the products are float32 (input_precision="ieee"); observed
# ~2e-7. float16: as on the GPU, dot operands and the softmax weights P are
# float16 and the output is rounded once more; observed ~3e-4. bfloat16: the
# interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest,
# about twice the error; observed 3e-3 to 7e-3.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture
def seed() -> int:
    """A fresh seed per test (KERNELS_SEED replays one), already applied to torch and random."""
    seed = int(os.environ.get("KERNELS_SEED") or random.SystemRandom().randrange(2**31))
    torch.manual_seed(seed)
    random.seed(seed)
    return seed


@pytest.fixture
def poison(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Float tensors from torch.empty / empty_like start as NaN (outputs and scratch alike)."""
    for name in ("empty", "empty_like"):
        real = getattr(torch, name)

        def poisoned(*args, _real=real, **kwargs) -> torch.Tensor:
            tensor = _real(*args, **kwargs)
            if tensor.is_floating_point():
                tensor.fill_(float("nan"))
            return tensor

        monkeypatch.setattr(torch, name, poisoned)
    yield


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def check(out: torch.Tensor, ref: torch.Tensor, tol: float, seed: int, what: str = "") -> None:
    replay = f"seed={seed} (replay with KERNELS_SEED={seed})"
    assert not out.isnan().any(), f"{what}: NaN in the output, an element unwritten? {replay}"
    err = rel_err(out, ref)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}; {replay}"


def make_paged_cache(
    context_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches and block tables: blocks shuffled over the cache, spare blocks in it,
    tables padded with -1, and every slot outside a sequence's context NaN."""
    needed = [cdiv(n, block_size) for n in context_lens]
    num_blocks = sum(needed) + 3
    order = torch.randperm(num_blocks).int()
    width = max(needed) + 2
    block_tables = torch.full((len(context_lens), width), -1, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    start = 0
    for i, (n, count) in enumerate(zip(context_lens, needed)):
        blocks = order[start : start + count]
        start += count
        block_tables[i, :count] = blocks
        slots = (blocks[:, None].long() * block_size + torch.arange(block_size)).flatten()[:n]
        for cache in (k_cache, v_cache):
            cache.view(-1, num_kv_heads, head_dim)[slots] = torch.randn(
                n, num_kv_heads, head_dim
            ).to(dtype)
    return k_cache, v_cache, block_tables


ATTENTION_CASES = [
    pytest.param(dtype, head_dim, gqa, block_size, id=f"{name}-D{head_dim}-gqa{gqa}-bs{block_size}")
    for name, dtype in [("f32", torch.float32), ("f16", torch.float16)]
    for head_dim in (64, 128)
    for gqa in (1, 2, 4)
    for block_size in (16, 64)
]


# ---------------------------------------------------------------------------- store_kvcache


@pytest.mark.parametrize("block_size", [16, 64], ids=lambda b: f"bs{b}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_store_kvcache(dtype: torch.dtype, block_size: int, seed: int) -> None:
    num_tokens, num_heads, num_kv_heads, head_dim, num_blocks = 23, 4, 2, 64, 5
    # k and v as strided views of one fused QKV output, as the model produces them.
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    k, v = qkv[:, num_heads : num_heads + num_kv_heads], qkv[:, num_heads + num_kv_heads :]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    slot_mapping = torch.randperm(num_blocks * block_size)[:num_tokens]
    slot_mapping[torch.rand(num_tokens) < 0.3] = -1

    store_kvcache(k, v, k_cache, v_cache, slot_mapping)

    stored = slot_mapping >= 0
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    written[slot_mapping[stored]] = True
    for name, cache, new in [("k", k_cache, k), ("v", v_cache, v)]:
        flat = cache.view(-1, num_kv_heads, head_dim)
        assert torch.equal(flat[slot_mapping[stored]], new[stored]), f"{name} seed={seed}"
        assert flat[~written].isnan().all(), (
            f"{name}: a slot not in slot_mapping changed; seed={seed}"
        )


# ---------------------------------------------------------------------------- decode attention


def random_decode_batch(
    context_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, ...]:
    k_cache, v_cache, block_tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype
    )
    q = torch.randn(len(context_lens), num_heads, head_dim).to(dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(context_lens, dtype=torch.int32)


@pytest.mark.parametrize(("dtype", "head_dim", "gqa", "block_size"), ATTENTION_CASES)
def test_decode_attention(
    dtype: torch.dtype, head_dim: int, gqa: int, block_size: int, seed: int, poison: None
) -> None:
    num_kv_heads = 2
    # Ragged: one token, a split boundary, several splits, and random lengths.
    context_lens = [1, KV_SPLIT_SIZE, 2 * KV_SPLIT_SIZE + random.randint(1, 200)]
    context_lens += [random.randint(1, 3 * KV_SPLIT_SIZE) for _ in range(2)]
    random.shuffle(context_lens)
    q, k_cache, v_cache, block_tables, lens = random_decode_batch(
        context_lens, num_kv_heads * gqa, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    out = torch.full_like(q, float("nan"))
    result = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale, out=out)
    assert result is out
    ref = reference.paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    check(out, ref, TOLERANCE[dtype], seed, f"context_lens={context_lens}")

    allocated = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, scale)
    assert torch.equal(allocated, out), f"out= changed the result; seed={seed}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_decode_attention_is_batch_invariant(dtype: torch.dtype, seed: int) -> None:
    """One sequence's output is bitwise the same alone and anywhere in a batch of 16."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 128, 16
    target_len = 2 * KV_SPLIT_SIZE + random.randint(1, KV_SPLIT_SIZE)  # three splits
    positions = (0, random.randint(1, 14), 15)  # first, somewhere inside, last
    lens = [random.randint(1, 3 * KV_SPLIT_SIZE) for _ in range(16)]
    for position in positions:
        lens[position] = target_len
    q, k_cache, v_cache, block_tables, context_lens = random_decode_batch(
        lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    scale = head_dim**-0.5
    batched = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    for position in positions:
        alone = paged_decode_attention(
            q[position : position + 1],
            k_cache,
            v_cache,
            block_tables[position : position + 1],
            context_lens[position : position + 1],
            scale,
        )
        assert torch.equal(alone[0], batched[position]), f"position {position}; seed={seed}"


def test_decode_attention_empty_context_gives_zeros(seed: int) -> None:
    """A padded batch entry (context 0, no blocks) yields zeros and leaves the others alone."""
    q, k_cache, v_cache, block_tables, context_lens = random_decode_batch(
        [37, 300], 4, 2, 64, 16, torch.float32
    )
    context_lens[0] = 0
    block_tables[0] = -1
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, 0.125)
    assert torch.equal(out[0], torch.zeros_like(out[0])), f"seed={seed}"
    ref = reference.paged_decode_attention(
        q[1:], k_cache, v_cache, block_tables[1:], context_lens[1:], 0.125
    )
    check(out[1:], ref, TOLERANCE[torch.float32], seed)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int8"])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_attention_over_a_quantized_cache(fmt: str, kind: str, seed: int, poison: None) -> None:
    """Both kernels read int8 or FP8 codes (FP8 decoded by arithmetic, not a cast)
    and scale them row by row: the result is float64 attention over the numbers
    the codes stand for."""
    from engine.config.kv_format import FORMATS
    from engine.kv.kv_cache import FullAttentionSpec
    from engine.kv.kv_cache import store_kvcache as store_torch
    from engine.kv.quant import dequantize

    num_kv_heads, heads, head_dim, block_size = 2, 4, 64, 16
    lens = [1, KV_SPLIT_SIZE + random.randint(1, 50), random.randint(2, 120)]
    k, v, tables = make_paged_cache(lens, block_size, num_kv_heads, head_dim, torch.float32)
    spec = FullAttentionSpec(num_kv_heads, head_dim, torch.float32).quantized(FORMATS[fmt])
    cache = spec.allocate(k.shape[0], block_size, torch.device("cpu"))
    flat = (-1, num_kv_heads, head_dim)
    slots = torch.arange(k.shape[0] * block_size)
    store_torch(k.reshape(flat).nan_to_num(0.0), v.reshape(flat).nan_to_num(0.0), cache, slots)
    k64 = dequantize(cache.k, cache.k_scale[..., None], torch.float64)
    v64 = dequantize(cache.v, cache.v_scale[..., None], torch.float64)
    ctx = torch.tensor(lens, dtype=torch.int32)
    scale = head_dim**-0.5
    quant = dict(k_scale=cache.k_scale, v_scale=cache.v_scale)
    if kind == "decode":
        q = torch.randn(len(lens), heads, head_dim)
        out = paged_decode_attention(q, cache.k, cache.v, tables, ctx, scale, **quant)
        ref = reference.paged_decode_attention(q.double(), k64, v64, tables, ctx, scale)
    else:
        query_lens = [1, random.randint(2, 40), lens[2]]  # a decode, a chunk, a whole prompt
        cu = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int()
        q = torch.randn(sum(query_lens), heads, head_dim)
        out = paged_prefill_attention(q, cache.k, cache.v, tables, cu, ctx, scale, **quant)
        ref = reference.paged_attention(q.double(), k64, v64, tables, cu, ctx, scale)
    check(out, ref, TOLERANCE[torch.float32], seed, f"{fmt} {kind} context_lens={lens}")


# ---------------------------------------------------------------------------- MLA decode


@pytest.mark.parametrize(
    ("rank", "rope", "num_heads", "block_size"),
    [(64, 16, 4, 16), (96, 8, 20, 64)],  # one head block; two, the second partial
    ids=lambda v: str(v),
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
def test_mla_decode(
    dtype: torch.dtype,
    rank: int,
    rope: int,
    num_heads: int,
    block_size: int,
    seed: int,
    poison: None,
) -> None:
    """Absorbed MLA decode over paged latents: ragged contexts, one and several splits."""
    context_lens = [1, KV_SPLIT_SIZE + random.randint(1, 100), random.randint(2, 200)]
    random.shuffle(context_lens)
    # A cache of one "head" of width rank + rope: make_paged_cache's layout, squeezed.
    cache, _, block_tables = make_paged_cache(context_lens, block_size, 1, rank + rope, dtype)
    cache = cache[:, :, 0].contiguous()
    q = torch.randn(len(context_lens), num_heads, rank + rope).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = (rank + rope) ** -0.5
    out = torch.full((len(context_lens), num_heads, rank), float("nan"), dtype=dtype)
    result = paged_mla_decode(q, cache, block_tables, lens, rank, scale, out=out)
    assert result is out
    ref = reference.paged_mla_decode(q, cache, block_tables, lens, rank, scale)
    check(out, ref, TOLERANCE[dtype], seed, f"context_lens={context_lens}")


# ---------------------------------------------------------------------------- prefill attention


@pytest.mark.parametrize(("dtype", "head_dim", "gqa", "block_size"), ATTENTION_CASES)
def test_prefill_attention(
    dtype: torch.dtype, head_dim: int, gqa: int, block_size: int, seed: int, poison: None
) -> None:
    """Plain prefill, a later chunk of a chunked prefill, a prefix-cache hit and a single token."""
    num_kv_heads = 2
    full = random.randint(BLOCK_M + 1, 3 * BLOCK_M)  # several query tiles
    chunk_prefix, chunk = random.randint(100, 200), random.randint(40, 90)  # any prefix length
    hit_prefix = block_size * random.randint(1, 3)  # a hit covers whole blocks
    hit_new = random.randint(1, 80)
    single_context = random.randint(2, 200)
    context_lens = [full, chunk_prefix + chunk, hit_prefix + hit_new, single_context]
    query_lens = [full, chunk, hit_new, 1]
    order = torch.randperm(4).tolist()
    context_lens = [context_lens[i] for i in order]
    query_lens = [query_lens[i] for i in order]

    k_cache, v_cache, block_tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, dtype
    )
    cu_seqlens_q = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0).int()
    q = torch.randn(sum(query_lens), num_kv_heads * gqa, head_dim).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    scale = head_dim**-0.5

    out = torch.full_like(q, float("nan"))
    result = paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale, out=out
    )
    assert result is out
    ref = reference.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, scale)
    check(out, ref, TOLERANCE[dtype], seed, f"context_lens={context_lens} query_lens={query_lens}")


def test_prefill_attention_strided_q(seed: int, poison: None) -> None:
    """q as a view of a fused QKV output, with max_seqlen_q given."""
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 64, 16
    context_lens, query_lens = [70, 33], [70, 5]
    k_cache, v_cache, block_tables = make_paged_cache(
        context_lens, block_size, num_kv_heads, head_dim, torch.float32
    )
    qkv = torch.randn(sum(query_lens), num_heads + 2 * num_kv_heads, head_dim)
    q = qkv[:, :num_heads]
    cu_seqlens_q = torch.tensor([0, 70, 75], dtype=torch.int32)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    out = paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, 0.125, max_seqlen_q=70
    )
    ref = reference.paged_attention(q, k_cache, v_cache, block_tables, cu_seqlens_q, lens, 0.125)
    check(out, ref, TOLERANCE[torch.float32], seed)


# ---------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("hidden", [1000, 2048], ids=lambda h: f"hidden{h}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rms_norm(dtype: torch.dtype, hidden: int, seed: int, poison: None) -> None:
    eps = 1e-6
    wide = torch.randn(9, hidden + 24).to(dtype) * 3
    x = wide[:, :hidden]  # rows strided, as a slice of a wider tensor
    residual = torch.randn(9, hidden).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden)).to(dtype)

    check(rms_norm(x, weight, eps), reference.rms_norm(x, weight, eps), TOLERANCE[dtype], seed)

    out, residual_out = fused_add_rms_norm(x, residual, weight, eps)
    summed = x + residual  # torch rounds the sum once to dtype, as the kernel should
    if dtype == torch.bfloat16:  # the interpreter truncates to bfloat16 instead of rounding
        check(residual_out, summed.double(), TOLERANCE[dtype], seed, "residual")
    else:
        assert torch.equal(residual_out, summed), f"residual; seed={seed}"
    check(out, reference.rms_norm(residual_out, weight, eps), TOLERANCE[dtype], seed, "norm")


# ---------------------------------------------------------------------------- rotary embedding


@pytest.mark.parametrize("head_dim", [64, 128], ids=lambda d: f"D{d}")
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_rotary_embedding(dtype: torch.dtype, head_dim: int, seed: int, poison: None) -> None:
    num_tokens, num_heads, num_kv_heads, max_position = 13, 6, 2, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(max_position).float()[:, None] * inv_freq[None, :]
    cos_sin_cache = torch.cat((angles.cos(), angles.sin()), dim=-1)
    positions = torch.randint(0, max_position, (num_tokens,))
    qkv = torch.randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim).to(dtype)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    q_before, k_before = q.clone(), k.clone()

    q_out, k_out = rotary_embedding(positions, q, k, cos_sin_cache)

    tol = TOLERANCE[dtype]
    check(q_out, reference.rotary_embedding(positions, q, cos_sin_cache), tol, seed, "q")
    check(k_out, reference.rotary_embedding(positions, k, cos_sin_cache), tol, seed, "k")
    assert torch.equal(q, q_before) and torch.equal(k, k_before), "the inputs changed"


# ---------------------------------------------------------------------------- availability


def test_check_available_on_cpu_with_interpreter(seed: int) -> None:
    """The check passes here, and rightly: its conditions hold and a kernel runs."""
    assert interpreter_active() and compiled_kernel_modules() == []
    assert check_available("cpu") is None
    assert check_available(torch.device("cpu")) is None
    x, weight = torch.randn(3, 64), torch.randn(64)
    check(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6), 1e-5, seed, "rms_norm")
    with pytest.raises(RuntimeError, match="not on meta"):
        check_available("meta")


def test_check_available_on_cpu_without_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match=r'TRITON_INTERPRET=1.*attention_backend="torch"'):
        check_available(torch.device("cpu"))


def test_check_available_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "triton", None)  # `import triton` now raises ImportError
    with pytest.raises(RuntimeError, match=r'Triton is not installed.*attention_backend="torch"'):
        check_available("cpu")


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_interpreter_set_after_import_is_repaired() -> None:
    """engine.kernels imported without TRITON_INTERPRET, then this module: the kernels still run."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_python(
        """
        import torch, triton
        import engine.kernels
        try:
            engine.kernels.check_available("cpu")
        except RuntimeError as exc:
            assert "TRITON_INTERPRET=1" in str(exc), exc
        else:
            raise AssertionError("check_available accepted the CPU without the interpreter")
        import os
        os.environ["TRITON_INTERPRET"] = "1"  # too late for the kernels already built
        try:
            engine.kernels.check_available("cpu")
        except RuntimeError as exc:
            assert "were imported before TRITON_INTERPRET=1 was set" in str(exc), exc
        else:
            raise AssertionError("check_available missed kernels built for the compiler")
        import tests.kernels.test_kernels  # sets the variable, and re-imports triton and the kernels
        from engine.kernels import check_available, rms_norm, reference
        check_available("cpu")
        x, w = torch.randn(3, 256), torch.randn(256)
        err = (rms_norm(x, w, 1e-6).double() - reference.rms_norm(x, w, 1e-6)).abs().max()
        assert err < 1e-5, err
        print("ok")
        """,
        env,
    )
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- compile for the GPU

COMPILE_FOR_SM90 = """
import sys, torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature
import engine.kernels as K

launches = []
class Recorder:  # stands in for a kernel: records the launch instead of running it
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((self.fn, args, kwargs))

for module in [m for n, m in list(sys.modules.items()) if n.startswith("engine.kernels.")]:
    for name, value in list(vars(module).items()):
        if name.endswith("_kernel"):  # launched kernels, not the helpers they call
            setattr(module, name, Recorder(value))

for dtype in (torch.bfloat16, torch.float16, torch.float32):
    k_cache = torch.randn(8, 16, 2, 128).to(dtype)
    tables = torch.arange(8, dtype=torch.int32).view(2, 4)
    lens = torch.tensor([50, 64], dtype=torch.int32)
    K.paged_decode_attention(torch.randn(2, 8, 128).to(dtype), k_cache, k_cache, tables, lens, 0.1)
    cu = torch.tensor([0, 10, 20], dtype=torch.int32)
    q = torch.randn(20, 8, 128).to(dtype)
    K.paged_prefill_attention(q, k_cache, k_cache, tables, cu, lens, 0.1, max_seqlen_q=10)
x = torch.randn(3, 4096).to(torch.bfloat16)
K.rms_norm(x, x[0], 1e-6)
K.fused_add_rms_norm(x, x, x[0], 1e-6)
q = torch.randn(3, 8, 128).to(torch.bfloat16)
K.rotary_embedding(torch.arange(3), q, q[:, :2], torch.randn(10, 128))
K.store_kvcache(q[:, :2], q[:, :2], k_cache.to(torch.bfloat16), k_cache.to(torch.bfloat16), torch.arange(3))
w = torch.zeros(200, 4096, dtype=torch.float8_e4m3fn)
K.fp8_gemm(x, w, torch.ones(200, 32), x[0, :200], fp8_dot=True)  # FP8 tensor cores
K.fp8_gemm(x, w, torch.ones(200, 32), None, fp8_dot=False)  # codes widened to bfloat16

# What JITFunction.run does before compiling, with an H100/H200 target instead
# of the (absent) current device: the same signature, constants and
# specialisations (16-byte alignment, divisibility) a real launch would get.
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
for fn, args, kwargs in launches:
    kwargs = dict(kwargs, debug=False)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    assert compiled.asm["cubin"], fn.__name__
    print(fn.__name__, "shared", compiled.metadata.shared)
print("compiled", len(launches))
"""


def test_kernels_compile_for_sm90(tmp_path) -> None:
    """The compiler accepts what the interpreter ran: every launch, compiled for sm_90 (no GPU
    needed; Triton ships ptxas). The interpreter is laxer, e.g. about loop-carried types."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silences 3.9's notice; the default
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    proc = run_python(COMPILE_FOR_SM90, env)
    if proc.returncode != 0 and "ImportError" in proc.stderr and "triton" in proc.stderr:
        pytest.skip(f"this Triton lacks the APIs the check uses:\n{proc.stderr[-2000:]}")
    assert proc.returncode == 0 and "compiled 17" in proc.stdout, proc.stdout + proc.stderr[-5000:]


# ---------------------------------------------------------------------------- the bench


def test_bench_checks_pass_in_the_interpreter(seed: int) -> None:
    """The bench's correctness checks (what it runs before timing) at their tiny CPU sizes."""
    from engine.tools import kernel_bench as bench

    dtypes = (torch.float32, torch.float16, torch.bfloat16)
    assert bench.run_checks("cpu", dtypes, tiny=True), f"seed={seed}"


def test_bench_without_cuda_says_so() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the bench would run")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "engine.tools.kernel_bench"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "CUDA GPU" in proc.stderr, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------- on a real GPU

ON_CUDA = """
import torch
from engine.kernels import paged_decode_attention
from engine.tools.kernel_bench import random_paged_cache, run_checks

assert run_checks("cuda", (torch.bfloat16, torch.float16, torch.float32), tiny=False)
lens = [int(n) for n in torch.randint(1, 5000, (16,))]
k_cache, v_cache, tables = random_paged_cache(lens, 8, 128, 16, torch.bfloat16, "cuda")
q = torch.randn(16, 32, 128, dtype=torch.bfloat16, device="cuda")
context_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
batched = paged_decode_attention(q, k_cache, v_cache, tables, context_lens, 0.1)
for i in range(16):
    alone = paged_decode_attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], context_lens[i : i + 1], 0.1)
    assert torch.equal(alone[0], batched[i]), i
print("ok")
"""


@pytest.mark.gpu
def test_compiled_kernels_on_cuda() -> None:
    """The compiled kernels on a GPU: the bench's checks, and batch invariance, bitwise.

    In a subprocess, because this module put the present one in interpreter mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = run_python(ON_CUDA, env)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-5000:]
