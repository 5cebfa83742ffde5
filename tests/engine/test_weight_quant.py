"""Weight-only int8 and int4, quantized at load (engine/layers/quantization/).

Their greedy tokens are not the full-precision model's, so the tests hold each
part to what it should compute: the quantize and dequantize arithmetic exactly,
torch's packed kernels against float64 on fresh random inputs, and the whole
model against transformers running the same dequantized weights unquantized
(each checkpoint tensor quantized on its own: rows and row groups do not change
when q, k and v are fused)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.layers.quantization.int_linear import Int8Linear, IntExperts
from engine.layers.quantization.int_weight import (
    int4_dequantize,
    int4_group,
    int4_linear,
    int4_pack,
    int4_quantize,
    int4_unpack,
    int8_dequantize,
    int8_linear,
    int8_quantize,
)
from tests.conftest import ROOT
from tests.engine.conftest import build_checkpoint, hf_greedy, hf_model_class, random_prompts

LEVELS = {"int8": 127, "int4": 7}
TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"


def quantize(method: str, w: torch.Tensor, dtype=torch.float32):
    if method == "int8":
        return int8_quantize(w, dtype)
    return int4_quantize(w, int4_group(w.shape[1]), dtype)


def dequantize(method: str, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return (int8_dequantize if method == "int8" else int4_dequantize)(q, scales)


@pytest.mark.parametrize("method", LEVELS)
@pytest.mark.parametrize("shape", [(16, 32), (48, 160), (64, 384), (32, 1024)], ids=str)
def test_quantize_rounds_to_the_nearest_level_of_its_scale(method, shape) -> None:
    g = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3
    w[1] = 0  # a zero row: scale 1, codes 0
    q, scales = quantize(method, w)
    levels = LEVELS[method]
    group = shape[1] if method == "int8" else int4_group(shape[1])
    s = scales.double().reshape(shape[0], -1).repeat_interleave(group, dim=1)
    blocks = w.double().view(shape[0], -1, group)
    amax = blocks.abs().amax(dim=2).repeat_interleave(group, dim=1)
    expected_s = torch.where(amax > 0, (amax / levels).float().double(), torch.ones_like(amax))
    assert torch.equal(s, expected_s)  # the group's largest magnitude over the top level
    quotient = (w.float() / s.float()).double()  # float32's quotient, rounded half to even
    assert torch.equal(q.double(), torch.round(quotient).clamp(-levels, levels))
    assert q.abs().max() == levels and not q[1].any()
    # float32's product: the exact one (8 + 24 bits fit a double) rounded once
    assert torch.equal(dequantize(method, q, scales), (q.double() * s).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 20])  # 20: past INT8_GEMV_TOKENS
@pytest.mark.parametrize("shape", [(16, 64), (48, 160), (96, 384), (32, 1024)], ids=str)
def test_int8_and_int4_kernels_match_float64(shape, tokens, dtype) -> None:
    g = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(shape, generator=g)
    x = torch.randn(tokens, shape[1], generator=g).to(dtype)
    for method in LEVELS:
        q, scales = quantize(method, w, dtype)
        exact = x.double() @ dequantize(method, q, scales).double().T
        if method == "int8":
            y = int8_linear(x, q, scales)
        else:
            y = int4_linear(x, *int4_pack(q, scales, dtype))
        bound = (x.double().abs() @ dequantize(method, q, scales).double().abs().T) * (
            shape[1] * 2.0**-23 if dtype == torch.float32 else 2.0**-7
        )
        assert y.dtype == dtype and y.shape == (tokens, shape[0])
        assert ((y.double() - exact).abs() <= bound + 1e-6).all(), method


def test_many_rows_take_the_weight_a_slice_at_a_time(monkeypatch) -> None:
    """int8_linear's dequantized_linear, with slices of 16 rows over a weight of
    40 rows (the last slice partial): every output column within float32's rounding of the
    float64 product, the tiny-scaled rows as much as the rest."""
    from engine.layers.quantization import int_weight

    g = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(40, 96, generator=g) * torch.logspace(-10, 10, 40)[:, None]
    q, scales = int8_quantize(w, torch.float32)
    x = torch.randn(24, 96, generator=g)
    monkeypatch.setattr(int_weight, "DEQUANTIZED_ROWS", 16)
    y = int_weight.int8_linear(x, q, scales)  # 24 rows: past the C++ operator
    w64 = int8_dequantize(q, scales).double()
    bound = (x.double().abs() @ w64.abs().T) * (96 + 2) * 2.0**-24
    assert y.shape == (24, 40) and y.dtype == torch.float32
    assert ((y.double() - x.double() @ w64.T).abs() <= bound).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 9])
@pytest.mark.parametrize("shape", [(1, 1), (3, 15), (17, 33), (40, 100), (24, 1024)], ids=str)
def test_the_int8_operator_matches_float64(shape, tokens, dtype) -> None:
    """engine/csrc/int8_linear.cpp on fresh random inputs: columns that end
    between vectors, more activation rows than one pass takes (8), a zero row,
    and scales from tiny to huge; within float32's rounding of the float64 sum."""
    from engine import csrc

    if not csrc.load():
        pytest.skip("the C++ operators could not be built here")
    g = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(shape, generator=g) * torch.logspace(-20, 20, shape[0])[:, None]
    w[0] = 0
    q, scales = int8_quantize(w, torch.float32)
    x = torch.randn(tokens, shape[1], generator=g).to(dtype)
    y = torch.ops.deepinfer.int8_gemv(x, q, scales)
    exact = x.double() @ int8_dequantize(q, scales).double().T
    bound = (x.double().abs() @ int8_dequantize(q, scales).double().abs().T) * (
        (shape[1] + 2) * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    )
    assert y.dtype == dtype and y.shape == (tokens, shape[0])
    assert ((y.double() - exact).abs() <= bound).all()
    assert not y[:, 0].any()


def test_float16_prompts_take_torchs_int4_dequantizer() -> None:
    """float16 activations past the C++ operator: dequantized by torch (the C++
    dequantizer takes float32 and bfloat16), the product F.linear's of that."""
    g = torch.Generator().manual_seed(torch.seed())
    q, scales = int4_quantize(torch.randn(48, 256, generator=g), 128, torch.float16)
    codes, s16 = int4_pack(q, scales, torch.float16)
    x = torch.randn(20, 256, generator=g).to(torch.float16)
    w = (q.float() * scales.float().repeat_interleave(128, dim=1)).to(torch.float16)
    assert torch.equal(int4_linear(x, codes, s16), torch.nn.functional.linear(x, w))


def test_the_int4_layout_holds_two_codes_a_byte_in_column_order() -> None:
    """int4_pack's byte i of a row holds columns 2i (low four bits) and 2i + 1
    (high), as q + 8; int4_unpack gives q back, every code from -8 to 7."""
    q = torch.arange(-8, 8, dtype=torch.int8).repeat(3, 2)  # 3 rows of 32 columns
    codes, scales = int4_pack(q, torch.ones(3, 1), torch.bfloat16)
    assert codes.dtype == torch.uint8 and codes.shape == (3, 16)
    assert codes[0, :8].tolist() == [(2 * i) | ((2 * i + 1) << 4) for i in range(8)]
    assert torch.equal(int4_unpack(codes), q) and scales.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("cols", "groups"), [(8, 4), (96, 3), (256, 4), (1024, 8), (64, 2)])
def test_the_int4_dequantize_operator_equals_torchs(dtype, cols, groups) -> None:
    """engine/csrc/int4_linear.cpp's int4_dequantize on fresh random codes and
    scales (down to subnormal products, groups of 2 columns to 128): bit for bit
    the weight that int4_dequantize_codes forms with torch, each q times its
    scale rounded once. (float16 goes torch's way: int4_linear.)"""
    from engine import csrc
    from engine.layers.quantization.int_weight import int4_dequantize_codes

    if not csrc.load():
        pytest.skip("the C++ operators could not be built here")
    g = torch.Generator().manual_seed(torch.seed())
    codes = torch.randint(0, 256, (37, cols // 2), generator=g, dtype=torch.uint8)
    scales = (torch.randn(37, groups, generator=g) * torch.logspace(-40, 4, 37)[:, None]).to(dtype)
    w = torch.ops.deepinfer.int4_dequantize(codes, scales)
    assert w.dtype == dtype and torch.equal(w, int4_dequantize_codes(codes, scales))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 2, 9])
@pytest.mark.parametrize("shape", [(1, 32), (3, 64), (17, 96), (40, 256), (24, 1024)], ids=str)
def test_the_int4_operator_matches_float64(shape, tokens, dtype) -> None:
    """engine/csrc/int4_linear.cpp on fresh random inputs: groups of 32, 64 and
    128 columns, more activation rows than one pass takes (8), a zero row, and
    scales from tiny to huge; within float32's rounding of the float64 sum."""
    from engine import csrc

    if not csrc.load():
        pytest.skip("the C++ operators could not be built here")
    g = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(shape, generator=g) * torch.logspace(-20, 20, shape[0])[:, None]
    w[0] = 0
    q, scales = int4_quantize(w, int4_group(shape[1]), torch.float32)
    x = torch.randn(tokens, shape[1], generator=g).to(dtype)
    y = torch.ops.deepinfer.int4_gemv(x, *int4_pack(q, scales, torch.float32))
    exact = x.double() @ int4_dequantize(q, scales).double().T
    bound = (x.double().abs() @ int4_dequantize(q, scales).double().abs().T) * (
        (shape[1] + 2) * 2.0**-24 if dtype == torch.float32 else 2.0**-8
    )
    assert y.dtype == dtype and y.shape == (tokens, shape[0])
    assert ((y.double() - exact).abs() <= bound).all()
    assert not y[:, 0].any()


MAX_TOKENS = 12
PROMPTS = random_prompts(4, seed=81)


def quantized_reference(arch: str, path: Path, method: str) -> torch.nn.Module:
    """transformers on the checkpoint's weights as the engine quantizes them:
    every linear layer but an untied output head and MLA's kv_b_proj, and a
    tied embedding table (which the head reads) in int8 under either method."""
    tensors = load_file(path / "model.safetensors")
    tied = json.loads((path / "config.json").read_text())["tie_word_embeddings"]
    for name, w in tensors.items():
        linear = name.endswith(("proj.weight", "_mqa.weight")) and "kv_b_proj" not in name
        if linear and w.dim() == 2:
            tensors[name] = dequantize(method, *quantize(method, w))
        elif tied and name.endswith("embed_tokens.weight"):
            tensors[name] = dequantize("int8", *quantize("int8", w))
    ref = path.parent / f"{path.name}-{method}"
    ref.mkdir()
    for file in path.glob("*.json"):
        (ref / file.name).write_bytes(file.read_bytes())
    save_file(tensors, ref / "model.safetensors", metadata={"format": "pt"})
    return hf_model_class(arch).from_pretrained(ref, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "deepseek-yarn"])
def plain(request, tmp_path_factory) -> tuple[str, Path]:
    """Four architectures; qwen2's head is tied to its embedding table."""
    path = tmp_path_factory.mktemp(request.param) / "model"
    build_checkpoint(request.param, path)
    return request.param, path


@pytest.mark.parametrize("method", LEVELS)
def test_greedy_tokens_match_the_dequantized_weights(plain, method) -> None:
    arch, path = plain
    reference = quantized_reference(arch, path, method)
    expected = [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for config in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 10}):
        llm = LLM(path, dtype="float32", quantization=method, **config)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == expected
    model = llm.llm_engine.executor.model_runner.model
    if arch == "qwen2":  # one int8 table, read by the embedding and the head
        assert isinstance(model.lm_head, Int8Linear)
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert model.lm_head.weight.dtype == torch.int8
    else:
        assert model.lm_head.weight.dtype == torch.float32
    if arch == "deepseek-yarn":
        assert all(isinstance(e, IntExperts) for e in model.experts())


@pytest.mark.parametrize("method", LEVELS)
def test_compiled_decode_takes_quantized_layers(tmp_path, method) -> None:
    build_checkpoint("qwen3", tmp_path / "model")
    reference = quantized_reference("qwen3", tmp_path / "model", method)
    llm = LLM(tmp_path / "model", dtype="float32", quantization=method, compile_decode=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert tokens == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]


def test_bad_quantization_is_refused_by_name(tmp_path) -> None:
    build_checkpoint("llama", tmp_path / "model")
    with pytest.raises(ValueError, match="quantization must be 'int8' or 'int4', got 'fp4'"):
        LLM(tmp_path / "model", quantization="fp4")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'int8' is refused: its checkpoint is already FP8"):
        LLM(tmp_path / "model", quantization="int8")


@pytest.mark.parametrize("method", LEVELS)
def test_what_quantized_weights_cannot_run_with_is_refused_by_name(tmp_path, method) -> None:
    """Expert parallelism moves and re-places experts as plain tensors, and
    batch-invariant mode's fixed-order matmuls have no int8 or int4 kernel: both
    are refused up front, naming the setting, not met at the first step."""
    build_checkpoint("deepseek-yarn", tmp_path / "moe")
    with pytest.raises(ValueError, match=f"'{method}' is refused: expert_parallel_size > 1"):
        EngineConfig(str(tmp_path / "moe"), quantization=method, expert_parallel_size=2)
    with pytest.raises(ValueError, match=f"'{method}' is refused: batch_invariant=True"):
        EngineConfig(str(TINY), dtype="float32", quantization=method, batch_invariant=True)


def test_the_command_line_passes_quantization_on(tmp_path) -> None:
    """--quantization on serve, generate and bench (vLLM's flag): serve's engine
    config carries it, and generate's text is the LLM's with the same option."""
    from engine.tools.cli import build_parser, serve_engine_config

    build_checkpoint("qwen3", tmp_path / "model")
    parse = build_parser().parse_args
    model = str(tmp_path / "model")
    assert serve_engine_config(parse(["serve", model, "--quantization", "int4"])).quantization == (
        "int4"
    )
    assert serve_engine_config(parse(["serve", model])).quantization is None
    for command in (["generate", "--model", model, "x"], ["bench", "--model", model]):
        assert parse([*command, "--quantization", "int8"]).quantization == "int8"
    with pytest.raises(SystemExit):
        parse(["serve", model, "--quantization", "fp4"])


def test_layers_are_quantized_as_their_weights_arrive(tmp_path) -> None:
    """While the checkpoint streams in, each layer is quantized once its last part
    (q, k or v of a fused layer) is copied and let go of, and its full-precision
    weight freed: the whole model is never held in full precision at once."""
    from engine.config import EngineConfig
    from engine.layers.quantization.int_loading import quantize_as_loaded
    from engine.models.loader import iterate_weights
    from engine.models.registry import build_model

    build_checkpoint("llama", tmp_path / "model")
    model = build_model(EngineConfig(str(tmp_path / "model"), dtype="float32").hf_config)
    dense = [m.weight for m in model.modules() if type(m) is torch.nn.Linear]
    stream = iterate_weights(tmp_path / "model")
    quantizing = quantize_as_loaded(stream, model, "int8", torch.float32, model.weight_target)
    counts = []

    def watched():
        for item in quantizing:
            counts.append(sum(isinstance(m, Int8Linear) for m in model.modules()))
            yield item

    with torch.no_grad():
        model.load_weights(watched())
    layers = len(dense) - 1  # all but the output head
    assert 0 < counts[len(counts) // 2] < layers
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == layers
    freed = [w for w in dense if w.untyped_storage().nbytes() <= 4]
    assert len(freed) == layers


def test_a_tied_table_is_quantized_once_it_arrives(tmp_path) -> None:
    """A tied embedding table becomes int8 as soon as its tensor is copied, early in
    the stream, and its full-precision storage is freed; the head reads its codes."""
    from engine.layers.quantization.int_linear import Int8Embedding
    from engine.layers.quantization.int_loading import quantize_as_loaded
    from engine.models.loader import iterate_weights
    from engine.models.registry import build_model

    build_checkpoint("qwen2", tmp_path / "model")
    model = build_model(EngineConfig(str(tmp_path / "model"), dtype="float32").hf_config)
    table = model.model.embed_tokens.weight
    stream = iterate_weights(tmp_path / "model")
    quantizing = quantize_as_loaded(stream, model, "int4", torch.float32, model.weight_target)
    left_after: list[bool] = []

    def watched():
        for name, tensor in quantizing:
            left_after.append(isinstance(model.model.embed_tokens, Int8Embedding))
            yield name, tensor

    with torch.no_grad():
        model.load_weights(watched())
    assert left_after.index(True) < len(left_after) // 2
    assert table.untyped_storage().nbytes() <= 4
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.embed_tokens.weight.dtype == torch.int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_quantized_by_slices_of_rows_equal_the_whole(dtype) -> None:
    """Int8Linear and Int4Linear quantize 256 rows at a time (small temporaries):
    the same codes, scales and outputs as quantizing the layer whole, with a bias."""
    from engine.layers.quantization.int_linear import Int4Linear

    g = torch.Generator().manual_seed(torch.seed())
    linear = torch.nn.Linear(384, 592, dtype=dtype)  # 592 rows: slices of 256, 256, 80
    with torch.no_grad():
        linear.weight.copy_(torch.randn(592, 384, generator=g))
    x = torch.randn(3, 384, generator=g).to(dtype)
    q8, s8 = int8_quantize(linear.weight.detach(), dtype)
    layer8 = Int8Linear(linear)
    assert torch.equal(layer8.weight, q8) and torch.equal(layer8.weight_scale, s8)
    assert torch.equal(layer8(x), int8_linear(x, q8, s8) + linear.bias)
    codes, s4 = int4_pack(*int4_quantize(linear.weight.detach(), 128, dtype), dtype)
    layer4 = Int4Linear(linear, 128)
    assert torch.equal(layer4.weight, codes) and torch.equal(layer4.weight_scale, s4)
    assert torch.equal(layer4(x), int4_linear(x, codes, s4) + linear.bias)
