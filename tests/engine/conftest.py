"""Tiny random-weight checkpoints built offline with transformers, and the
transformers outputs the engine must match token for token."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

VOCAB = 320
EOS = 2  # "<eos>" in the test tokenizer


TOKENIZER_CORPUS = [
    "def schedule(self) -> SchedulerOutput:\n    budget = self.max_num_batched_tokens\n",
    "for seq in self.running:\n    if not self.block_manager.allocate(seq, n):\n        break\n",
    "A request waits, runs, is preempted and resumes; its tokens are never lost.\n",
    "The scheduler admits sequences while the token budget and the free blocks last.\n",
    "Keys and values live in blocks of the paged cache, shared through reference counts.\n",
    "naïve café — 東京 😀 done; return tokens, positions, slot_mapping\n",
] * 20


def build_tokenizer(path: Path) -> None:
    """A byte-level BPE trained offline on a fixed corpus, so tests see the same
    tokenizer whatever the engine's source looks like today."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<pad>", "<bos>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TOKENIZER_CORPUS, trainer)
    tok.save(str(path / "tokenizer.json"))


def hf_config(arch: str):
    import transformers

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=512,
        initializer_range=0.1,  # peaked logits: greedy choices are far from ties
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=1,
    )
    if arch == "llama":  # GQA 2, untied head, llama3 RoPE scaling
        return transformers.LlamaConfig(
            **common,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if arch == "qwen2":  # MHA, q/k/v biases, tied embeddings
        return transformers.Qwen2Config(**common, num_key_value_heads=4, tie_word_embeddings=True)
    if arch == "qwen3":  # GQA 4, q/k norm, head_dim wider than hidden/heads, untied
        return transformers.Qwen3Config(
            **common, num_key_value_heads=1, head_dim=32, tie_word_embeddings=False
        )
    if arch.startswith("deepseek"):
        return deepseek_config(arch, common)
    raise ValueError(arch)


def deepseek_config(arch: str, common: dict):
    """Two tiny DeepSeek-V3s that between them take every branch: low-rank or direct
    queries, plain or YaRN RoPE, interleaved or neox rotary layout, several expert
    groups or one, normalised or raw top-k weights; the first has an MTP module."""
    import transformers

    mla_moe = dict(
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        moe_intermediate_size=32,
        n_routed_experts=8,
        first_k_dense_replace=1,
        num_key_value_heads=4,  # unused by MLA; transformers' default (128) breaks eager
        tie_word_embeddings=False,
    )
    if arch == "deepseek":
        return transformers.DeepseekV3Config(
            **common,
            **mla_moe,
            q_lora_rank=24,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rope_interleave=True,
            n_group=4,
            topk_group=2,
            num_experts_per_tok=3,
            n_shared_experts=1,
            norm_topk_prob=True,
            routed_scaling_factor=2.5,
            num_nextn_predict_layers=1,
        )
    if arch == "deepseek-yarn":
        return transformers.DeepseekV3Config(
            **common,
            **mla_moe,
            q_lora_rank=None,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 64,  # prompts reach past it
                "mscale": 1.0,
                "mscale_all_dim": 0.8,  # both the cos/sin and the softmax scale move
                "beta_fast": 32,
                "beta_slow": 1,
            },
            rope_interleave=False,
            n_group=1,
            topk_group=1,
            num_experts_per_tok=2,
            n_shared_experts=2,
            norm_topk_prob=False,
            routed_scaling_factor=1.0,
            num_nextn_predict_layers=0,
        )
    raise ValueError(arch)


def hf_model_class(arch: str):
    import transformers

    return {
        "llama": transformers.LlamaForCausalLM,
        "qwen2": transformers.Qwen2ForCausalLM,
        "qwen3": transformers.Qwen3ForCausalLM,
        "deepseek": transformers.DeepseekV3ForCausalLM,
        "deepseek-yarn": transformers.DeepseekV3ForCausalLM,
    }[arch]


def add_mtp_weights(model: torch.nn.Module, path: Path, layer_class: type | None = None) -> None:
    """transformers builds no MTP module; write random ones into the checkpoint as
    DeepSeek stores them: layer num_hidden_layers + k, with copies of the embedding and
    the output head (which the engine shares) beside the module's own tensors.
    ``layer_class``: the model's decoder layer (default DeepSeek-V3's)."""
    from safetensors.torch import load_file, save_file
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

    cfg = model.config
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    for k in range(cfg.num_nextn_predict_layers):
        n = cfg.num_hidden_layers + k
        block = (layer_class or DeepseekV3DecoderLayer)(cfg, n)
        width = cfg.hidden_size
        module = block.state_dict() | {
            "enorm.weight": torch.ones(width),
            "hnorm.weight": torch.ones(width),
            "eh_proj.weight": torch.empty(width, 2 * width),
            "shared_head.norm.weight": torch.ones(width),
        }
        for name, t in module.items():
            if name.endswith("norm.weight"):
                t = 1 + 0.1 * torch.randn(t.shape, generator=g)
            else:
                t = 0.1 * torch.randn(t.shape, generator=g)
            if name.startswith("mlp.experts."):  # one set of matrices per expert, as saved
                stacked = name.split(".")[-1]
                for e, m in enumerate(t):
                    halves = [m] if stacked == "down_proj" else m.chunk(2)
                    projs = ["down_proj"] if stacked == "down_proj" else ["gate_proj", "up_proj"]
                    for proj, h in zip(projs, halves):
                        tensors[f"model.layers.{n}.mlp.experts.{e}.{proj}.weight"] = h.clone()
            else:
                tensors[f"model.layers.{n}.{name}"] = t
        tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors[
            "model.embed_tokens.weight"
        ].clone()
        tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def build_checkpoint(
    arch: str, path: Path, seed: int = 0, config_overrides: dict | None = None, **save_kwargs
) -> torch.nn.Module:
    """``config_overrides``: config fields set after hf_config's (wider shapes)."""
    torch.manual_seed(seed)
    config = hf_config(arch)
    for key, value in (config_overrides or {}).items():
        setattr(config, key, value)
    model = hf_model_class(arch)(config).eval()
    if arch.startswith("deepseek"):  # transformers zeroes the routing biases; make them count
        with torch.no_grad():
            for layer in model.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    if arch == "qwen2":  # transformers initialises biases to zero; make them count
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.1)
    model.save_pretrained(path, **save_kwargs)
    if arch == "deepseek":
        add_mtp_weights(model, path)
    build_tokenizer(path)
    return model


ARCHS = ["llama", "qwen2", "qwen3", "deepseek", "deepseek-yarn"]


@pytest.fixture(scope="session", params=ARCHS)
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """(arch, folder, transformers model) for each architecture."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, build_checkpoint(request.param, path)


@pytest.fixture(scope="session")
def qwen3(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("qwen3-single")
    return path, build_checkpoint("qwen3", path)


@pytest.fixture(scope="session")
def deepseek(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek-single")
    return path, build_checkpoint("deepseek", path)


@pytest.fixture(scope="session")
def deepseek_yarn(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek-yarn-single")
    return path, build_checkpoint("deepseek-yarn", path)


def random_prompts(n: int, seed: int, low: int = 3, high: int = 60) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(low, high, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate on one unpadded prompt: the oracle."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: with tiny models and small tensors, one
    thread is faster than two fighting a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
