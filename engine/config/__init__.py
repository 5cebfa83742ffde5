"""How the engine serves one model: EngineConfig, the settings a caller gives
(engine.py), and its parts, each checking itself (parts.py), with what two
parts cannot do together refused in one place (combinations.py); what the
checkpoint says of the model (model.py, with DeepSeek-V4's own in
deepseek_v4.py and its FP8 weights' in fp8_format.py); speculative decoding's
(speculative.py); the KV cache's element formats (kv_format.py) and its groups,
the kinds of cached state with a block table each (cache_groups.py).

Every folder of the engine may import this one: it imports nothing of the
engine but its own modules."""

from engine.config.engine import COMPILE_MODES, EngineConfig, cpu_has_fast_bf16, default_cpu_dtype

__all__ = ["COMPILE_MODES", "EngineConfig", "cpu_has_fast_bf16", "default_cpu_dtype"]
