"""Loading checkpoints: sharded safetensors with an index, tied embeddings, and
clear errors for folders that are incomplete."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from tests.engine.conftest import build_checkpoint, hf_greedy, random_prompts


def test_sharded_checkpoint_loads_and_matches(tmp_path) -> None:
    model = build_checkpoint("llama", tmp_path, seed=3, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    prompt = random_prompts(1, seed=61)[0]
    out = LLM(tmp_path, dtype="float32").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    assert out[0].token_ids == hf_greedy(model, prompt, 8)


def test_missing_weight_is_named(qwen3, tmp_path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(qwen3[0], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks weights for: model\.layers\.1\.mlp\.gate_up_proj\.weight"
    ):
        LLM(folder, dtype="float32")


def test_folder_without_weights_or_config(qwen3, tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        LLM(tmp_path / "empty", dtype="float32")
    folder = tmp_path / "noweights"
    shutil.copytree(qwen3[0], folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights"):
        LLM(folder, dtype="float32")


def test_token_ids_work_without_a_tokenizer(qwen3, tmp_path) -> None:
    """Token ids in, the same token ids out as with a tokenizer, and no text."""
    folder = tmp_path / "m"
    shutil.copytree(qwen3[0], folder)
    (folder / "tokenizer.json").unlink()
    llm = LLM(folder, dtype="float32")
    prompt = random_prompts(1, seed=62)[0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop=["never"])
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert out.token_ids == hf_greedy(qwen3[1], prompt, 6)
    assert out.text == "" and out.finish_reason == "length"
    with pytest.raises(ValueError, match="no tokenizer.json; pass token ids"):
        llm.generate("hello", use_tqdm=False)


def test_a_deepseek_checkpoint_as_transformers_saves_it_loads_without_mtp(tmp_path, caplog) -> None:
    """transformers' DeepseekV3Config declares one MTP layer by default and its model
    saves none: the engine serves the checkpoint without MTP, says so once, and
    decodes transformers' greedy tokens."""
    import logging

    from tests.engine.conftest import build_tokenizer, hf_config, hf_greedy, hf_model_class

    torch.manual_seed(0)
    cfg = hf_config("deepseek")
    cfg.num_nextn_predict_layers = 1  # transformers' default, whatever the file says
    model = hf_model_class("deepseek")(cfg).eval()
    model.save_pretrained(tmp_path)  # exactly as save_pretrained writes it: no MTP tensors
    build_tokenizer(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.WARNING, logger="engine.config.model"):
        llm = LLM(str(tmp_path), dtype="float32", num_kv_blocks=16)
    assert [r for r in caplog.records if "without MTP" in r.getMessage()]
    assert llm.llm_engine.config.hf_config.num_mtp_layers == 0
    prompt = [5, 17, 99, 3, 42, 8, 61]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert out[0].token_ids == hf_greedy(model, prompt, 6)


def test_models_are_built_without_random_draws(qwen3) -> None:
    """Building under no_random_init draws no random number (the checkpoint fills
    every parameter next, or the load is refused), and puts torch's own init back
    afterwards: a layer built outside it is drawn as before."""
    from engine.config.model import ModelConfig
    from engine.models.loader import no_random_init
    from engine.models.registry import build_model

    config = ModelConfig.from_pretrained(qwen3[0])
    torch.manual_seed(0)
    with no_random_init():
        build_model(config)
    after_build = torch.rand(4)
    torch.manual_seed(0)
    assert torch.equal(after_build, torch.rand(4))  # the build drew nothing
    torch.manual_seed(0)
    drawn = torch.nn.Linear(8, 8).weight.detach().clone()
    torch.manual_seed(0)
    assert torch.equal(drawn, torch.nn.Linear(8, 8).weight)  # drawn, and drawn the same
    assert drawn.abs().sum() > 0
