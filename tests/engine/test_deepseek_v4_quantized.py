"""DeepSeek-V4 served from its published quantized layout: FP8 layers with
one-byte power-of-two block scales, and FP4 routed experts, two values a byte.

The oracle (tests/engine/v4_checkpoints.py): a tiny random V4 (three attention
layer types, a hash-routed layer, an MTP module) quantized in DeepSeek's layout,
with partial blocks and groups, a zero block and a zero group; transformers runs
the same weights dequantized by DeepSeek's rule. In float32 the engine's greedy
tokens from the quantized checkpoint equal transformers' under every scheduling
regime, with MTP drafting and with the experts on two ranks; the layers stay in
their stored bytes; the FP4 arithmetic equals a float64 reference on every
code; and a checkpoint that breaks the layout is refused by the tensor's name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams, csrc
from engine.config.fp8_format import fp8_format
from engine.layers.quantization import fp4
from engine.layers.quantization.fp4_experts import Fp4Experts
from engine.layers.quantization.fp8 import Fp8Linear
from tests.engine.conftest import hf_greedy
from tests.engine.test_deepseek_v4 import PROMPTS, REGIMES, build
from tests.engine.test_deepseek_v4_mtp import add_mtp
from tests.engine.v4_checkpoints import (
    E2M1,
    GROUP,
    QUANTIZATION,
    WIDE,
    fp4_dequantized,
    fp4_quantize,
    quantize_v4_checkpoint,
)

MAX_TOKENS = 12
UE8M0 = torch.float8_e8m0fnu


@pytest.fixture(scope="module")
def quantized(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    """(the quantized checkpoint, transformers' greedy tokens from its dequantized copy)."""
    import transformers

    root = tmp_path_factory.mktemp("deepseek-v4-quantized")
    path, reference = root / "v4", root / "reference"
    build(path, "three-types", **WIDE)
    add_mtp(path, "three-types")
    quantize_v4_checkpoint(path, reference)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    return path, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def generate(path: Path, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm


SCHEDULES = {name: REGIMES[name] for name in ("block-8", "chunked-prefill", "preemption")}
SCHEDULES["async-chunked"] = REGIMES["async-chunked"]


@pytest.mark.parametrize("regime", SCHEDULES, ids=list(SCHEDULES))
def test_greedy_tokens_match_the_dequantized_checkpoint(quantized, regime) -> None:
    path, reference = quantized
    tokens, llm = generate(path, **SCHEDULES[regime])
    assert tokens == reference, regime
    if "chunked" in regime:
        assert llm.stats.partial_prefills > 0
    if regime == "preemption":
        assert llm.stats.preemptions > 0


def test_the_layers_stay_in_their_stored_bytes(quantized) -> None:
    """Every FP8 matrix is an Fp8Linear (wo_a included, read a group at a time),
    every routed expert packed FP4 with one-byte scales; what the release keeps in
    full precision stays so."""
    path, _ = quantized
    model = LLM(path, dtype="float32", num_kv_blocks=8).llm_engine.executor.model_runner.model
    for block in (*model.layers, *model.mtp):
        attn = block.attn
        for linear in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b):
            assert isinstance(linear, Fp8Linear) and linear.weight.dtype == torch.float8_e4m3fn
        if attn.compressor is not None:
            assert not isinstance(attn.compressor.wkv, Fp8Linear)
        if attn.indexer is not None:
            assert isinstance(attn.indexer.wq_b, Fp8Linear)
            assert not isinstance(attn.indexer.weights_proj, Fp8Linear)
        assert isinstance(block.ffn.shared_experts.gate_up_proj, Fp8Linear)
        experts = block.ffn.experts
        assert isinstance(experts, Fp4Experts)
        hidden, width = WIDE["hidden_size"], WIDE["moe_intermediate_size"]
        assert experts.gate_up_proj.shape == (8, 2 * width, hidden // 2)
        assert experts.gate_up_proj.dtype == torch.uint8
        assert experts.down_proj_scale_inv.shape == (8, hidden, -(-width // GROUP))
        assert experts.down_proj_scale_inv.dtype == UE8M0
    assert isinstance(model.mtp[0].e_proj, Fp8Linear)
    assert model.head.weight.dtype == torch.float32


def test_mtp_drafts_from_the_quantized_module(quantized) -> None:
    """The MTP module (FP8 projections and attention, FP4 experts) drafts; greedy
    verification keeps transformers' tokens."""
    path, reference = quantized
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    tokens, llm = generate(path, speculative_config=spec, block_size=8)
    assert tokens == reference
    assert llm.stats.spec_decode.num_draft_tokens > 0


def test_expert_parallel_reads_each_ranks_fp4_experts(quantized) -> None:
    """EP=2: each rank loads only its slots' packed experts and their scales, and
    again after EPLB places them anew with two redundant slots."""
    path, reference = quantized
    llm = LLM(path, dtype="float32", expert_parallel_size=2, **REGIMES["chunked-prefill"])
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
        llm.rebalance_experts(num_redundant=2)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
    finally:
        llm.shutdown()


def test_bfloat16_serves_the_quantized_checkpoint(quantized) -> None:
    """In bfloat16 the dequantized weights are exact (a 2- or 4-bit significand times
    a power of two), so transformers in bfloat16 on them is the oracle, as for the
    plain checkpoint (test_deepseek_v4.py): the same greedy tokens under chunked
    prefill."""
    import transformers

    path, _ = quantized
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
        path.parent / "reference", dtype=torch.bfloat16
    ).eval()
    prompts = PROMPTS[2:]
    llm = LLM(path, dtype="bfloat16", block_size=8, max_num_batched_tokens=13)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]


def test_fp8_experts_without_expert_dtype(tmp_path) -> None:
    """V4's other layout: routed experts in FP8 blocks like the dense layers, no
    expert_dtype. They become Fp8Experts, with V4's clipped SwiGLU."""
    import transformers

    from engine.layers.quantization.fp8_experts import Fp8Experts

    build(tmp_path / "v4", "hash-only", **WIDE)
    quantize_v4_checkpoint(tmp_path / "v4", tmp_path / "reference", experts="fp8")
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "reference", dtype=torch.float32
    )
    tokens, llm = generate(tmp_path / "v4", block_size=8)
    assert tokens == [hf_greedy(hf.eval(), p, MAX_TOKENS) for p in PROMPTS]
    experts = llm.llm_engine.executor.model_runner.model.layers[0].ffn.experts
    assert isinstance(experts, Fp8Experts) and experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.act.limit == 10.0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_int_weights_on_deepseek_v4(tmp_path, method: str) -> None:
    """Weight-only int8 and int4 (--quantization) on a plain V4 checkpoint: every
    linear layer and the routed experts quantized at load but the head and wo_a
    (read by weight a group at a time); greedy tokens equal transformers' on the
    same weights quantized and dequantized. (wo_a quantized made project() fail.)"""
    import transformers

    from engine.layers.quantization.int_linear import IntExperts, int4_fits
    from tests.engine.test_weight_quant import dequantize as int_dequantize
    from tests.engine.test_weight_quant import quantize as int_quantize

    build(tmp_path / "v4", "three-types")
    tensors = load_file(tmp_path / "v4" / "model.safetensors")
    kept = ("head.weight", "embed_tokens.weight", ".wo_a.weight", ".gate.weight")
    for name, w in tensors.items():
        if not (name.endswith(".weight") and w.dim() == 2) or name.endswith(kept):
            continue
        if method == "int8" or int4_fits(*w.shape):  # int4 leaves misfits as they are
            tensors[name] = int_dequantize(method, *int_quantize(method, w))
    reference = edited(tmp_path / "v4", tmp_path / "reference", lambda t: t.update(tensors))
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(reference, dtype=torch.float32)
    tokens, llm = generate(tmp_path / "v4", quantization=method, block_size=8)
    assert tokens == [hf_greedy(hf.eval(), p, MAX_TOKENS) for p in PROMPTS]
    model = llm.llm_engine.executor.model_runner.model
    assert type(model.layers[0].attn.wo_a) is torch.nn.Linear
    assert type(model.head) is torch.nn.Linear
    assert type(model.layers[0].attn.wo_b) is not torch.nn.Linear
    # int4 needs only a group dividing a row: wq_a's 24 rows are quantized too
    assert type(model.layers[0].attn.wq_a) is not torch.nn.Linear
    assert all(isinstance(e, IntExperts) for e in model.experts())


# The FP4 arithmetic against float64, on fresh random inputs every run.


def random_packed(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    return torch.randint(0, 256, (rows, cols // 2), generator=g, dtype=torch.uint8)


DEQUANTIZERS = {"c++": fp4.fp4_dequantize, "torch": fp4.fp4_dequantize_torch}
LINEARS = {"c++ gemv": fp4.fp4_linear, "tiles": fp4.fp4_tiled_linear}


def needs_csrc(way: str) -> None:
    """The C++ operators' cases need them built (else the engine keeps to torch)."""
    if way.startswith("c++") and not csrc.load():
        pytest.skip("no C++ compiler to build engine/csrc")


@pytest.mark.parametrize("way", DEQUANTIZERS)
def test_every_byte_dequantizes_to_its_two_e2m1_values(way) -> None:
    """All 256 bytes, low nibble first, sign of zero kept, with scales from 2^-127
    to 2^127 (e8m0's whole range) and float32 scales that are not powers of two."""
    needs_csrc(way)
    dequantize = DEQUANTIZERS[way]
    packed = torch.arange(256, dtype=torch.uint8)[None].repeat(3, 1)  # 512 columns, 16 groups
    exponents = torch.linspace(-127, 127, 16).round()
    pow2 = torch.exp2(torch.stack([exponents, exponents.flip(0), torch.zeros(16)]))
    for scales in (pow2.to(UE8M0), pow2, pow2 * 1.3):
        got = dequantize(packed, scales, torch.float32)
        want = fp4_dequantized(packed, scales.float())
        assert torch.equal(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want))
        assert torch.equal(dequantize(packed, scales, torch.bfloat16), want.bfloat16())
    values = dequantize(packed[:1], torch.ones(1, 16), torch.float32)[0]
    pairs = [(E2M1[b & 15], E2M1[b >> 4]) for b in range(16)]
    assert values[:32].tolist() == [v for pair in pairs for v in pair]


@pytest.mark.parametrize("way", DEQUANTIZERS)
@pytest.mark.parametrize("cols", [32, 48, 160, 144, 2, 1056])
def test_dequantize_partial_and_zero_groups_match_float64(way, cols) -> None:
    """Rows ending in a partial group (48, 144: 16 columns; 2: one byte), a zero
    group, and bfloat16 as DeepSeek's float32 product rounded once."""
    needs_csrc(way)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    w = torch.randn(5, cols, generator=g) * torch.exp2(torch.randint(-60, 60, (5, 1), generator=g))
    w[1, :GROUP] = 0
    packed, scales = fp4_quantize(w)
    packed = packed.view(torch.uint8)
    want = fp4_dequantized(packed, scales)
    for stored in (scales, scales.to(UE8M0)):
        got = DEQUANTIZERS[way](packed, stored, torch.float32)
        assert torch.equal(got, want)
        assert torch.equal(DEQUANTIZERS[way](packed, stored, torch.bfloat16), want.bfloat16())
    assert (want[1, : min(cols, GROUP)] == 0).all()


@pytest.mark.parametrize("way", LINEARS)
@pytest.mark.parametrize("rows,cols", [(300, 160), (7, 96), (1, 2), (33, 1040)])
def test_fp4_linear_matches_float64(monkeypatch, way, rows, cols) -> None:
    """x times the dequantized weight, from the packed bytes (up to 16 tokens) or
    one tile of rows at a time (tiles of 64 rows here, the last partial), in
    float32 and bfloat16 activations, within float32 rounding of the float64
    product of the same values."""
    needs_csrc(way)
    monkeypatch.setattr(fp4, "TILE_VALUES", 64 * cols)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    packed = random_packed(rows, cols, g)
    scales = torch.exp2(torch.randint(-8, 8, (rows, -(-cols // GROUP)), generator=g).float())
    w = fp4_dequantized(packed, scales).double()
    for tokens in (1, 5, 16, 40):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(tokens, cols, generator=g).to(dtype)
            want = x.double() @ w.T
            got = LINEARS[way](x, packed, scales.to(UE8M0))
            assert got.dtype == dtype and got.shape == (tokens, rows)
            bound = 1e-6 * (x.double().abs() @ w.abs().T) + 1e-30
            if dtype == torch.bfloat16:  # the float32 sum, rounded once to bfloat16
                bound = bound + want.abs() * 2.0**-8
            assert ((got.double() - want).abs() <= bound).all(), (tokens, dtype)


# Refusals, by the tensor's name or the config's key.


def edited(path: Path, to: Path, change=None, config=None) -> Path:
    to.mkdir()
    for file in path.iterdir():
        if file.suffix == ".json":
            (to / file.name).write_bytes(file.read_bytes())
    tensors = load_file(path / "model.safetensors")
    if change is not None:
        change(tensors)
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        raw = json.loads((to / "config.json").read_text())
        config(raw)
        (to / "config.json").write_text(json.dumps(raw))
    return to


W1 = "layers.1.ffn.experts.3.w1"
WQ_A = "layers.0.attn.wq_a"


def _pop(name: str):
    return lambda t: t.pop(name)


def _set(name: str, value):
    return lambda t: t.__setitem__(name, value(t[name]))


BROKEN = {
    "missing-fp4-scale": (_pop(f"{W1}.scale"), f"'{W1}.weight' is FP4 but has no scale"),
    "missing-fp8-scale": (_pop(f"{WQ_A}.scale"), f"'{WQ_A}.weight' is FP8 but has no scale"),
    "fp4-scale-per-128": (
        _set(f"{W1}.scale", lambda s: s[:, :2].contiguous()),
        rf"'{W1}.scale' has shape \(144, 2\); a 144 x 160 FP4 weight",
    ),
    "fp8-scale-per-row": (
        _set(f"{WQ_A}.scale", lambda s: s.repeat(24, 1)),
        rf"'{WQ_A}.scale' has shape \(24, 2\); a 24 x 160 weight",
    ),
    "fp4-scale-float16": (
        _set(f"{W1}.scale", lambda s: s.float().half()),
        f"'{W1}.scale' is torch.float16, not float32 or float8_e8m0fnu",
    ),
    "fp4-scale-not-power-of-two": (
        _set(f"{W1}.scale", lambda s: s.float() * 1.5),
        f"scale_fmt is ue8m0 but '{W1}.scale' holds a non-power of two",
    ),
    "fp4-outside-the-experts": (
        _set(f"{WQ_A}.weight", lambda w: torch.zeros(24, 80, dtype=torch.int8)),
        f"'{WQ_A}.weight' is FP4, but layers.0.attn.wq_a cannot be",
    ),
    "fp8-routed-expert": (
        _set(f"{W1}.weight", lambda w: torch.zeros(144, 160, dtype=torch.float8_e4m3fn)),
        f"'{W1}.weight' is FP8, but quantization_config expert_dtype is 'fp4'",
    ),
    "e5m2-weight": (
        _set(f"{WQ_A}.weight", lambda w: w.float().to(torch.float8_e5m2)),
        f"'{WQ_A}.weight' is F8_E5M2; FP8 weights must be E4M3",
    ),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_checkpoint_is_refused_by_tensor_name(quantized, tmp_path, case) -> None:
    change, message = BROKEN[case]
    with pytest.raises(ValueError, match=message):
        LLM(edited(quantized[0], tmp_path / case, change), dtype="float32", num_kv_blocks=8)


def test_fp4_experts_need_expert_dtype_fp4(quantized, tmp_path) -> None:
    """Without expert_dtype fp4, the int8 experts are refused, naming one."""
    path = edited(quantized[0], tmp_path / "fp8-experts", config=lambda c: c.pop("expert_dtype"))
    with pytest.raises(ValueError, match=r"experts\.\d+\.w[123]\.weight' is I8, packed FP4"):
        LLM(path, dtype="float32", num_kv_blocks=8)


def v4_raw(top: dict | None = None, **quant) -> dict:
    """A V4 config.json's dict: DeepSeek-V4-Flash's quantization_config with
    ``quant`` changed, and ``top`` at the top level."""
    config = {"quantization_config": QUANTIZATION | quant}
    return {"architectures": ["DeepseekV4ForCausalLM"], **config, **(top or {})}


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (v4_raw({"expert_dtype": "fp6"}), "unsupported quantization_config expert_dtype 'fp6'"),
        (v4_raw(expert_dtype="int4"), "unsupported quantization_config expert_dtype 'int4'"),
        (
            v4_raw({"architectures": ["Qwen3ForCausalLM"], "expert_dtype": "fp4"}),
            "expert_dtype 'fp4' for Qwen3ForCausalLM: FP4 experts are DeepseekV4ForCausalLM's",
        ),
        (v4_raw(scale_fmt="e5m2"), "unsupported quantization_config scale_fmt 'e5m2'"),
        (
            v4_raw(weight_block_size=[1, 32]),
            r"unsupported quantization_config weight_block_size \[1, 32\]",
        ),
        (v4_raw(quant_method="mxfp4"), "unsupported quantization_config quant_method 'mxfp4'"),
        (v4_raw(fmt="e2m1"), "unsupported quantization_config fmt 'e2m1'"),
    ],
)
def test_an_unknown_format_is_refused_by_key(raw, message) -> None:
    with pytest.raises(ValueError, match=message):
        fp8_format(raw)


def test_v4_formats_read_as_transformers_reads_them() -> None:
    """expert_dtype at the top level (V4) or in quantization_config (V4.1); and
    transformers' scale_fmt 'float' is float32 scales."""
    top, inside = (
        fp8_format(v4_raw({"expert_dtype": "fp4"})),
        fp8_format(v4_raw(expert_dtype="fp4")),
    )
    assert top == inside and top.expert_dtype == "fp4" and top.scale_fmt == "ue8m0"
    plain = fp8_format(v4_raw(scale_fmt="float"))
    assert plain.scale_fmt is None and plain.expert_dtype == "fp8"
