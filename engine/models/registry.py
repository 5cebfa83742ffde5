"""Which class serves which architecture, by the name a checkpoint's config.json gives it."""

from __future__ import annotations

from engine.config.model import SUPPORTED_ARCHITECTURES, ModelConfig
from engine.models.base import CausalLM
from engine.models.deepseek_v3 import DeepseekV3ForCausalLM
from engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from engine.models.deepseek_v32 import DeepseekV32ForCausalLM
from engine.models.llama import LlamaForCausalLM

# Qwen2 is Llama with biases on q, k and v; Qwen3 adds a norm on q and k. The
# config flags (attention_bias, qk_norm) carry the difference.
MODEL_REGISTRY: dict[str, type[CausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV32ForCausalLM": DeepseekV32ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
}
assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def build_model(config: ModelConfig) -> CausalLM:
    return MODEL_REGISTRY[config.architecture](config)
