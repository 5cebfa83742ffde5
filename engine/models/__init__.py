"""The models: the architectures (llama.py, deepseek_v3.py) and what they share
(base.py), the checkpoint's config (config.py), which class serves which
architecture (registry.py) and how weights are loaded (loader.py)."""
