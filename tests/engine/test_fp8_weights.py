"""DeepSeek's block-scaled FP8 checkpoints, served from their own bytes.

The oracle (tests/engine/fp8_checkpoints.py): a tiny random checkpoint quantized
in DeepSeek's layout, with partial 128 x 128 blocks and a zero block, and the same
weights dequantized by DeepSeek's rule into a plain checkpoint that transformers
runs. In float32 the engine's greedy tokens from the FP8 checkpoint equal
transformers' from the plain one, under every scheduling regime; the layers stay
in FP8; and a checkpoint that breaks the layout is refused by the tensor's name.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.quantization.fp8 import Fp8Linear
from engine.layers.quantization.fp8_experts import Fp8Experts
from tests.engine.conftest import hf_greedy, random_prompts
from tests.engine.fp8_checkpoints import build_fp8_checkpoint

MAX_TOKENS = 12
PREFIX = random_prompts(1, seed=71, low=40, high=41)[0]
PROMPTS = [PREFIX + p for p in random_prompts(2, seed=72, low=2, high=20)]
PROMPTS += random_prompts(3, seed=73)

CONFIGS = {
    "defaults": {},
    "chunked-prefill": {"max_num_batched_tokens": 24},
    "preemption": {"num_kv_blocks": 10},
}


def engine_model(llm: LLM) -> torch.nn.Module:
    return llm.llm_engine.executor.model_runner.model


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "deepseek", "deepseek-yarn"])
def fp8(request, tmp_path_factory) -> tuple[str, Path, list[list[int]]]:
    """(arch, FP8 checkpoint, transformers' greedy tokens from its dequantized copy)."""
    path = tmp_path_factory.mktemp(f"fp8-{request.param}")
    model = build_fp8_checkpoint(request.param, path / "fp8", path / "reference")
    return request.param, path / "fp8", [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def generate(path: Path, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_greedy_tokens_match_the_dequantized_checkpoint(fp8, config) -> None:
    arch, path, reference = fp8
    tokens, llm = generate(path, **CONFIGS[config])
    assert tokens == reference, f"{arch}/{config}"
    if config == "chunked-prefill":
        assert llm.stats.partial_prefills > 0
    if config == "preemption":
        assert llm.stats.preemptions > 0


def test_the_layers_stay_in_fp8(fp8) -> None:
    """Every linear layer the checkpoint stores in FP8 is served from FP8 bytes
    with its scales; the embedding and the head stay as they were."""
    arch, path, _ = fp8
    model = engine_model(LLM(path, dtype="float32", num_kv_blocks=8))
    linears = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert len(linears) >= 4 * model.config.num_hidden_layers - 2
    for layer in linears:
        assert layer.weight.dtype == torch.float8_e4m3fn
        assert layer.weight_scale_inv.shape == (layer.out_features, -(-layer.in_features // 128))
    experts = [m for m in model.modules() if isinstance(m, Fp8Experts)]
    assert len(experts) == (len(model.experts()) if arch.startswith("deepseek") else 0)
    assert all(e.gate_up_proj.dtype == torch.float8_e4m3fn for e in experts)
    assert model.lm_head.weight.dtype == torch.float32


@pytest.mark.parametrize("fp8", ["qwen3", "deepseek"], indirect=True)
def test_compiled_decode_takes_fp8_layers(fp8) -> None:
    """The compiled decode step calls FP8 layers as opaque operators."""
    arch, path, reference = fp8
    tokens, _ = generate(path, compile_decode=True)
    assert tokens == reference


@pytest.mark.parametrize("fp8", ["qwen3", "deepseek"], indirect=True)
def test_async_scheduling_reads_fp8_layers(fp8) -> None:
    _, path, reference = fp8
    assert generate(path, async_scheduling=True, max_num_batched_tokens=24)[0] == reference


@pytest.mark.parametrize("fp8", ["deepseek"], indirect=True)
def test_mtp_drafts_from_the_fp8_module(fp8) -> None:
    """The checkpoint's MTP module (layer num_hidden_layers, FP8 like the rest, its
    eh_proj included) drafts, and greedy verification keeps the tokens transformers
    gives on the dequantized weights. (The module's weights are random: its drafts
    are checked, and rejected.)"""
    _, path, reference = fp8
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    tokens, llm = generate(path, speculative_config=spec)
    assert tokens == reference
    model = engine_model(llm)
    assert isinstance(model.model.mtp[0].eh_proj, Fp8Linear)
    assert llm.stats.spec_decode.num_draft_tokens > 0


@pytest.fixture(scope="module")
def ue8m0(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = tmp_path_factory.mktemp("fp8-ue8m0")
    model = build_fp8_checkpoint("deepseek", path / "fp8", path / "reference", ue8m0=True)
    return path / "fp8", [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def test_power_of_two_scales(ue8m0, tmp_path) -> None:
    """scale_fmt ue8m0 (V3.1 on): the same tokens from float32 scales that are
    powers of two, or from one-byte float8_e8m0fnu scales."""
    path, reference = ue8m0
    assert generate(path)[0] == reference
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        tensors[name] = tensors[name].to(torch.float8_e8m0fnu)
    copy = edited(path, tmp_path / "e8m0", tensors)
    assert generate(copy)[0] == reference


def edited(path: Path, to: Path, tensors: dict, quant: dict | None = None) -> Path:
    """A copy of the checkpoint in ``path`` with these tensors and quantization_config
    fields."""
    to.mkdir()
    for file in path.iterdir():
        if file.suffix == ".json" and file.name != "config.json":
            (to / file.name).write_bytes(file.read_bytes())
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] |= quant or {}
    (to / "config.json").write_text(json.dumps(config))
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


def broken(fp8_path: Path, tmp_path: Path, change) -> Path:
    tensors = load_file(fp8_path / "model.safetensors")
    change(tensors)
    return edited(fp8_path, tmp_path / "broken", tensors)


@pytest.fixture(scope="module")
def qwen3_fp8(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fp8-qwen3-errors")
    build_fp8_checkpoint("qwen3", path / "fp8", path / "reference")
    return path / "fp8"


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def _drop_scale(t: dict) -> None:
    del t[O_PROJ + "_scale_inv"]


def _wrong_grid(t: dict) -> None:
    t[O_PROJ + "_scale_inv"] = t[O_PROJ + "_scale_inv"][:1]


def _e5m2(t: dict) -> None:
    t[O_PROJ] = t[O_PROJ].float().to(torch.float8_e5m2)


def _orphan_scale(t: dict) -> None:
    t["model.layers.0.input_layernorm.weight_scale_inv"] = torch.ones(1, 2)


def _bf16_in_fused(t: dict) -> None:
    name = "model.layers.0.self_attn.k_proj.weight"
    t[name] = t[name].float()
    del t[name + "_scale_inv"]


def _half_scale(t: dict) -> None:
    t[O_PROJ + "_scale_inv"] = t[O_PROJ + "_scale_inv"].half()


BROKEN = {
    "missing-scale": (_drop_scale, f"{O_PROJ}' is FP8 but has no"),
    "wrong-scale-shape": (_wrong_grid, f"{O_PROJ}_scale_inv' has shape (1, 1)"),
    "e5m2-weight": (_e5m2, f"{O_PROJ}' is F8_E5M2; FP8 weights must be E4M3"),
    "scale-without-weight": (_orphan_scale, "input_layernorm.weight_scale_inv' has no FP8"),
    "mixed-fused-layer": (_bf16_in_fused, "k_proj.weight' is torch.float32 in an FP8 layer"),
    "float16-scale": (_half_scale, "o_proj.weight_scale_inv' is torch.float16, not float32"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_a_broken_checkpoint_is_refused_by_tensor_name(qwen3_fp8, tmp_path, case) -> None:
    change, message = BROKEN[case]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LLM(broken(qwen3_fp8, tmp_path, change), dtype="float32", num_kv_blocks=8)


BAD_CONFIG = {
    "quant_method": ("awq", "quant_method 'awq'"),
    "weight_block_size": ([64, 64], r"weight_block_size \[64, 64\]"),
    "fmt": ("e5m2", "fmt 'e5m2'"),
    "activation_scheme": ("static", "activation_scheme 'static'"),
    "scale_fmt": ("e4m3", "scale_fmt 'e4m3'"),
}


@pytest.mark.parametrize("key", BAD_CONFIG)
def test_an_unknown_quantization_config_is_refused_by_key(qwen3_fp8, tmp_path, key) -> None:
    value, message = BAD_CONFIG[key]
    path = edited(qwen3_fp8, tmp_path / "bad", load_file(qwen3_fp8 / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"][key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"unsupported quantization_config {message}"):
        LLM(path, dtype="float32", num_kv_blocks=8)


def test_ue8m0_scales_must_be_powers_of_two(qwen3_fp8, tmp_path) -> None:
    path = edited(
        qwen3_fp8,
        tmp_path / "ue8m0",
        load_file(qwen3_fp8 / "model.safetensors"),
        {"scale_fmt": "ue8m0"},
    )
    with pytest.raises(ValueError, match="scale_fmt is ue8m0 but 'model.layers.0"):
        LLM(path, dtype="float32", num_kv_blocks=8)


def test_deepseek_v32_with_its_indexer_in_fp8(tmp_path) -> None:
    """V3.2: the indexer's wq_b and wk in FP8 too (weights_proj stays as stored),
    MLA over the positions it chose."""
    import transformers

    from tests.engine.conftest import build_tokenizer
    from tests.engine.fp8_checkpoints import WIDE, quantize_checkpoint
    from tests.engine.test_dsa import dsa_config

    torch.manual_seed(0)
    wide = {k: v for k, v in WIDE.items() if k != "intermediate_size"}
    model = transformers.DeepseekV32ForCausalLM(dsa_config(**wide, index_topk=8)).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.indexer.k_norm.weight.normal_(1, 0.1)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(tmp_path / "fp8")
    build_tokenizer(tmp_path / "fp8")
    quantize_checkpoint(tmp_path / "fp8", tmp_path / "reference")
    reference = transformers.DeepseekV32ForCausalLM.from_pretrained(
        tmp_path / "reference", dtype=torch.float32
    ).eval()
    tokens, llm = generate(tmp_path / "fp8", block_size=8)
    assert tokens == [hf_greedy(reference, p, MAX_TOKENS) for p in PROMPTS]
    indexer = engine_model(llm).model.layers[0].self_attn.indexer
    assert isinstance(indexer.wq_b, Fp8Linear) and isinstance(indexer.wk, Fp8Linear)
    assert not isinstance(indexer.weights_proj, Fp8Linear)


@pytest.mark.parametrize("fp8", ["deepseek"], indirect=True)
def test_expert_parallel_and_a_new_placement_read_fp8_experts(fp8) -> None:
    """EP=2: each rank loads its slots' FP8 experts and their scales, and again
    after EPLB places them anew (two copies of some): the same tokens."""
    _, path, reference = fp8
    llm = LLM(path, dtype="float32", expert_parallel_size=2, max_num_batched_tokens=24)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
        llm.rebalance_experts(num_redundant=4)
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == reference
    finally:
        llm.shutdown()


# Widths at which every FP8 matrix is whole 128 x 128 blocks, or one block: where
# transformers' own FP8 loader, which derives the block from the scale grid, reads
# DeepSeek's layout as DeepSeek does.
WHOLE_BLOCKS = {
    "qwen3": {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 32},
    "deepseek": {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128,
                 "q_lora_rank": 128, "kv_lora_rank": 64, "qk_rope_head_dim": 64,
                 "qk_nope_head_dim": 64, "v_head_dim": 64, "qk_head_dim": 128, "head_dim": 64,
                 "num_attention_heads": 2},
}  # fmt: skip


@pytest.mark.parametrize("arch", WHOLE_BLOCKS)
def test_transformers_own_fp8_loader_agrees(arch, tmp_path) -> None:
    """A cross-check of the oracle: transformers' FineGrainedFP8 loader (which on a
    CPU dequantizes at load, and needs accelerate) reads the FP8 checkpoint into
    the same logits as our dequantized copy, and the engine's greedy tokens from
    the FP8 bytes equal its."""
    from tests.engine.conftest import build_checkpoint, hf_model_class
    from tests.engine.fp8_checkpoints import quantize_checkpoint

    build_checkpoint(arch, tmp_path / "fp8", seed=1, config_overrides=WHOLE_BLOCKS[arch])
    quantize_checkpoint(tmp_path / "fp8", tmp_path / "reference")
    theirs = hf_model_class(arch).from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    ours = hf_model_class(arch).from_pretrained(tmp_path / "reference", dtype=torch.float32)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        assert torch.equal(theirs(ids).logits, ours.eval()(ids).logits)
    tokens, _ = generate(tmp_path / "fp8")
    assert tokens == [hf_greedy(theirs, p, MAX_TOKENS) for p in PROMPTS]
