"""DeepSeek-V3's own attention widths on a random checkpoint: a latent rank of
512 with 64 rotary numbers, so each cached row is 576 numbers wide, and
v_head_dim equal to qk_nope_head_dim (128), as the published config has them
(the other DeepSeek tests use narrower, unequal widths to keep them fast).
Greedy tokens equal transformers' through the C++ decode operator and the torch
backend, chunked and preempted; the quantized MLA caches give one answer alone,
chunked, preempted and from the prefix cache; and the FP8 weight layout, whose
576-row kv_a_proj_with_mqa ends in a partial block, serves the same tokens as its
dequantized copy does in transformers."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams, csrc
from engine.layers.quantization.fp8 import Fp8Linear
from tests.engine.conftest import build_checkpoint, hf_greedy, hf_model_class, random_prompts
from tests.engine.fp8_checkpoints import quantize_checkpoint

MAX_TOKENS = 12
V3_WIDTHS = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "qk_head_dim": 192,  # transformers derives these two at construction
    "head_dim": 64,
    "num_attention_heads": 2,
}
PROMPTS = random_prompts(4, seed=21, low=5, high=70)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def v3(tmp_path_factory) -> tuple[Path, list[list[int]]]:
    path = tmp_path_factory.mktemp("deepseek-v3-widths")
    model = build_checkpoint("deepseek", path, seed=3, config_overrides=V3_WIDTHS)
    assert model.config.kv_lora_rank + model.config.qk_rope_head_dim == 576
    return path, [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


RUNS = {
    "cpu-operator": {},
    "torch-chunked": {"attention_backend": "torch", "max_num_batched_tokens": 24},
    "preempted": {"num_kv_blocks": 9, "block_size": 8, "max_num_batched_tokens": 24},
}


@pytest.mark.parametrize("run", RUNS, ids=list(RUNS))
def test_greedy_tokens_match_transformers_at_v3_widths(v3, run: str) -> None:
    if run == "cpu-operator" and not csrc.load():
        pytest.skip("no C++ compiler to build engine/csrc")
    path, reference = v3
    llm = LLM(path, dtype="float32", **RUNS[run])
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == reference, run
    pool = llm.llm_engine.executor.model_runner.kv_cache
    assert pool.block_bytes() == 2 * pool.block_size * 576 * 4  # two layers, float32 rows
    if run == "preempted":
        assert llm.llm_engine.stats.preemptions > 0


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3"])
def test_a_quantized_latent_cache_gives_one_answer_however_scheduled(v3, name: str) -> None:
    path, _ = v3
    common = dict(dtype="float32", kv_cache_dtype=name, block_size=8)
    alone = []
    for p in PROMPTS:
        llm = LLM(path, **common, enable_prefix_caching=False)
        alone += [o.token_ids for o in llm.generate([p], GREEDY, use_tqdm=False)]
    crowded = LLM(path, **common, num_kv_blocks=9, max_num_batched_tokens=16)
    assert [o.token_ids for o in crowded.generate(PROMPTS, GREEDY, use_tqdm=False)] == alone
    assert crowded.llm_engine.stats.preemptions > 0
    cached = LLM(path, **common, max_num_batched_tokens=16)
    i = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))  # the longest: whole blocks
    twice = [cached.generate([PROMPTS[i]], GREEDY, use_tqdm=False)[0] for _ in range(2)]
    assert [o.token_ids for o in twice] == [alone[i]] * 2  # the second from the first's blocks
    assert cached.llm_engine.stats.prefix_cache_hit_tokens > 0
    codes = [t for c in cached.llm_engine.executor.model_runner.kv_cache._caches()
             for t in c.tensors() if t.dtype != torch.float32]  # fmt: skip
    assert codes and all(t.element_size() == 1 for t in codes)


def test_fp8_weights_at_v3_widths(v3, tmp_path) -> None:
    """DeepSeek-V3's FP8 layout on these widths: kv_a_proj_with_mqa has 576 rows,
    so its last 128-row block is partial (64 rows), as in the published
    checkpoints. Greedy tokens from the FP8 bytes equal transformers' on the same
    weights dequantized by DeepSeek's rule, chunked, and the layer keeps a scale
    for each of its 576 rows' five row blocks."""
    path, _ = v3
    shutil.copytree(path, tmp_path / "fp8")
    quantize_checkpoint(tmp_path / "fp8", tmp_path / "reference")
    model = hf_model_class("deepseek").from_pretrained(tmp_path / "reference", dtype=torch.float32)
    reference = [hf_greedy(model.eval(), p, MAX_TOKENS) for p in PROMPTS]
    llm = LLM(tmp_path / "fp8", dtype="float32", max_num_batched_tokens=24)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)] == reference
    layer = llm.llm_engine.executor.model_runner.model.model.layers[0].self_attn.kv_a_proj_with_mqa
    assert isinstance(layer, Fp8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.out_features == 576 and layer.weight_scale_inv.shape[0] == 576
    assert llm.llm_engine.stats.partial_prefills > 0
