"""Attention backends: the same paged attention, computed two ways.

``torch`` is the reference and runs everywhere. ``triton`` runs the kernels in
engine/kernels and is the default on CUDA. Both start from the same metadata,
built once per step by the model runner, and read the same paged KV cache.

A backend is the engine's one kernel switch: it also chooses the kernels for
RMSNorm and RoPE, which the layers call through the step's forward context.

The package has three seams: ``metadata.py`` (one step's batch, as attention
sees it), ``backend.py`` (the Protocol every backend meets, and ``get_backend``)
and ``context.py`` (the step's metadata and kernels, visible to every layer).
"""
