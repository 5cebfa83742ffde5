"""The C++ paged decode-attention operator (engine/csrc) against the float64
reference and the torch backend, on fresh random inputs each run.

Block tables are shuffled over the whole cache, and every block no sequence
owns is poisoned with NaN, so a read outside a sequence's blocks (or past its
context in its last block, which is poisoned too) fails the comparison.
CPU_OPS_SEED=<seed> replays a failure.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from engine import csrc
from engine.attention.torch_backend import TorchBackend
from engine.config.kv_format import quant_format
from engine.kernels import reference
from engine.kv.kv_cache import LatentKV, PagedKV
from engine.kv.quant import quantize
from engine.tools.cpu_attention_bench import decode_only_metadata
from engine.tools.kernel_bench import random_paged_cache, rel_err
from tests.conftest import ROOT

SEED = int(os.environ.get("CPU_OPS_SEED", random.randrange(2**31)))
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}  # relative, against float64

pytestmark = pytest.mark.skipif(not csrc.load(), reason="no C++ compiler to build engine/csrc")


def poisoned_inputs(lens, heads, kv_heads, head_dim, block_size, dtype):
    k, v, tables = random_paged_cache(lens, kv_heads, head_dim, block_size, dtype, "cpu", 3)
    owned = torch.zeros(k.shape[:2], dtype=torch.bool)
    for row, n in zip(tables, lens):
        for j, block in enumerate(row[row >= 0].tolist()):
            owned[block, : min(block_size, n - j * block_size)] = True
    k[~owned], v[~owned] = float("nan"), float("nan")
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [1, 16, 64])
# 64 and 128 run the unrolled copies of the kernel, 32 the general one.
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"), [(4, 4, 64), (8, 4, 128), (8, 2, 64), (4, 1, 32)]
)
def test_matches_float64_and_the_torch_backend(dtype, block_size, heads, kv_heads, head_dim):
    gen = random.Random(SEED)
    torch.manual_seed(SEED)
    lens = [gen.randint(1, 300) for _ in range(gen.randint(1, 6))] + [1, block_size + 1]
    q, k, v, tables, ctx = poisoned_inputs(lens, heads, kv_heads, head_dim, block_size, dtype)
    scale = head_dim**-0.5
    out = torch.ops.deepinfer.paged_decode_attention(q, k, v, tables, ctx, scale)
    ref = reference.paged_decode_attention(q, k, v, tables, ctx, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert rel_err(out, ref) < TOLERANCE[dtype], f"seed {SEED}"

    # The torch backend's decode path, on the same step: the two backends agree.
    meta = decode_only_metadata(tables, lens)
    backend = TorchBackend(block_size)
    clean_k, clean_v = k.nan_to_num(0.0), v.nan_to_num(0.0)  # the torch path reads padding
    expect = backend.forward(
        q, None, None, PagedKV(clean_k, clean_v), backend.build_metadata(meta), scale
    )
    assert rel_err(out, expect.double()) < TOLERANCE[dtype], f"seed {SEED}"


def test_bad_arguments_get_a_clear_error():
    q, k, v, tables, ctx = poisoned_inputs([5], 4, 2, 64, 16, torch.float32)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.deepinfer.paged_decode_attention(q.double(), k, v, tables, ctx, 0.1)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        torch.ops.deepinfer.paged_decode_attention(q[:, :3], k, v, tables, ctx, 0.1)
    with pytest.raises(RuntimeError, match="int32"):
        torch.ops.deepinfer.paged_decode_attention(q, k, v, tables.long(), ctx, 0.1)


def test_without_a_compiler_the_engine_says_so_once_and_uses_torch(tmp_path):
    """A machine with no C++ compiler still runs the engine, on the torch path."""
    script = textwrap.dedent(
        """
        import sys, warnings
        warnings.simplefilter("default")
        from engine import LLM
        a = LLM(sys.argv[1], dtype="float32")
        b = LLM(sys.argv[1], dtype="float32")
        print(a.llm_engine.config.attention_backend, b.llm_engine.config.attention_backend)
        """
    )
    env = dict(os.environ, CXX="/nonexistent/c++", TORCH_EXTENSIONS_DIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-c", script, str(ROOT / "snippets/models/deepinfer-tiny")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["torch", "torch"]
    assert proc.stderr.count("C++ CPU operators could not be built") == 1, proc.stderr


def test_the_cpu_default_decodes_through_the_operator():
    from engine import LLM

    llm = LLM(str(ROOT / "snippets/models/deepinfer-tiny"), dtype="float32")
    assert llm.llm_engine.config.attention_backend == "cpu"
    assert type(llm.llm_engine.executor.model_runner.backend).__name__ == "CpuBackend"


def test_decode_groups_are_built_only_for_a_layer_that_reads_them():
    """A dense model's decodes all go through the operator, and so do MLA's over
    a plain cache: the CPU backend builds the torch backend's decode groups for
    neither. MLA's decode over a quantized cache still attends through torch,
    and gets them, built once per step."""
    from engine.attention.cpu_backend import CpuBackend

    lens = [5, 40, 17]
    q, k, v, tables, ctx = poisoned_inputs(lens, 4, 4, 64, 16, torch.float32)
    backend = CpuBackend(16)
    attn = backend.build_metadata(decode_only_metadata(tables, lens))
    assert attn.decode_groups == [] and attn.prefill_chunks == []
    backend.forward(q, None, None, PagedKV(k, v), attn, 64**-0.5)
    backend.mla_decode(q.flatten(1)[:, None], LatentKV(k.flatten(2)), 192, attn, 0.1)
    assert attn.decode_groups == []  # neither path asked
    codes, scales = quantize(k.nan_to_num(0.0).flatten(2)[..., :192], quant_format("int8"), 64)
    latents = LatentKV(codes, scales, k.nan_to_num(0.0).flatten(2)[..., 192:].contiguous())
    out = backend.mla_decode(q.flatten(1)[:, None], latents, 192, attn, 0.1)
    groups = attn.decode_groups
    assert sum(len(g.rows) for g in groups) == len(lens) and out.shape == (3, 1, 192)
    backend.mla_decode(q.flatten(1)[:, None], latents, 192, attn, 0.1)
    assert attn.decode_groups is groups  # the next layer reuses them


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
# deepinfer-tiny-moe's rows, and DeepSeek-V3's (512 + 64 numbers, 128 heads on one rank).
@pytest.mark.parametrize(("heads", "rank", "rope"), [(4, 64, 16), (16, 512, 64)])
def test_mla_decode_through_the_operator_matches_float64(dtype, heads, rank, rope):
    """The latent rows as the operator's one KV head, keys and values at once:
    the first ``rank`` numbers of each head's sum are the absorbed attention's
    output. Rows no sequence owns are NaN, as above, so a stray read fails."""
    from engine.attention.cpu_backend import CpuBackend

    gen = random.Random(SEED)
    torch.manual_seed(SEED)
    lens = [gen.randint(1, 200) for _ in range(gen.randint(1, 5))] + [1, 17]
    q, rows, _, tables, ctx = poisoned_inputs(lens, heads, 1, rank + rope, 16, dtype)
    backend = CpuBackend(16)
    attn = backend.build_metadata(decode_only_metadata(tables, lens))
    scale = (rank + rope) ** -0.5
    out = backend.mla_decode(q, LatentKV(rows[:, :, 0]), rank, attn, scale)
    ref = reference.paged_mla_decode(q, rows[:, :, 0], tables, ctx, rank, scale)
    assert out.dtype == dtype and out.shape == (len(lens), heads, rank)
    assert rel_err(out, ref) < TOLERANCE[dtype], f"seed {SEED}"
    assert attn.decode_groups == []  # the torch path was never taken
