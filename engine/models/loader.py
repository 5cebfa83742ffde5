"""Loading a Hugging Face checkpoint folder: config.json, safetensors weights
(one file, or shards listed by an index), and tokenizer.json. Nothing is
fetched from a hub: the folder must hold everything."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from tokenizers import Tokenizer
from torch import nn

from engine.config import EngineConfig
from engine.layers.quantization.fp8_loading import (
    Fp8Layers,
    fp8_weights,
    quantize_modules,
    quantized_weights,
)
from engine.layers.quantization.int_loading import quantize_as_loaded, quantize_weights
from engine.models.base import CausalLM
from engine.models.registry import build_model

logger = logging.getLogger(__name__)


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    return files


def iterate_weights(
    path: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, or those ``wanted`` names: the others are never read."""
    for file in safetensors_files(path):
        if not file.is_file():
            raise ValueError(f"the index names a shard that is missing: {file}")
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = [n for n in f.keys() if wanted is None or wanted(n)]  # noqa: SIM118
        for name in names:
            # A fresh handle per tensor: safe_open maps the whole file, and every page
            # read through a mapping stays in this process's memory until the mapping
            # goes. One handle for all would hold a second copy of the model at the
            # end of loading; this way the peak is the model plus one tensor.
            with safe_open(str(file), framework="pt", device="cpu") as f:
                yield name, f.get_tensor(name)


@contextmanager
def no_random_init() -> Iterator[None]:
    """Build linear and embedding layers without drawing their random weights:
    every parameter is overwritten by the checkpoint next (each model's
    load_weights proves it, or refuses the checkpoint), and the draws cost seconds
    for a model of 0.6B parameters. Their memory stays unwritten until the
    weights land in it. (transformers' no_init_weights does the same.)"""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = _no_init  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved  # type: ignore[method-assign]


def _no_init(module: nn.Module) -> None:
    pass


def load_model(config: EngineConfig, local_experts: list[list[int]] | None = None) -> CausalLM:
    """Build the model on its device in its dtype (no_random_init), then copy the
    weights in. With ``local_experts`` (expert parallelism), each MoE layer holds
    only those experts' slots, and no other routed expert's weights are read."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(config.dtype)
    try:
        with torch.device(config.device), no_random_init():
            model = build_model(config.hf_config)
    finally:
        torch.set_default_dtype(previous)
    path = Path(config.model)
    fp8 = config.hf_config.fp8
    if fp8 is not None:  # FP8 and FP4 layers take their checkpoint's format before loading
        quantized = quantized_weights(path, fp8)
        names = quantize_modules(model, quantized, model.weight_target, model.plain_linears, fp8)
        model.fp8 = Fp8Layers(fp8, frozenset(names), quantized)
    wanted = None
    if local_experts is not None:
        model.place_experts(local_experts)
        wanted = model.wants_weight
    weights = model_weights(path, model, wanted)
    method, dtype = config.quantization, config.dtype
    plain = model.plain_linears + model.unquantized_linears
    if method is not None:  # each layer quantized once loaded, its weight freed
        weights = quantize_as_loaded(weights, model, method, dtype, model.weight_target, plain)
    with torch.no_grad():
        model.load_weights(weights)
        if method is not None and (left := quantize_weights(model, method, dtype, plain)):
            logger.info("%s leaves these layers unquantized: %s", method, left)
    return model.eval().requires_grad_(False)


def model_weights(
    path: Path, model: CausalLM, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """iterate_weights, with an FP8 checkpoint's scales checked and paired with
    their weights (layers/quantization/fp8_loading.py) for the model's FP8 layers."""
    weights = iterate_weights(path, wanted)
    fp8 = model.fp8
    if fp8 is None:
        return weights

    def keeps(name: str) -> bool:
        target = model.weight_target(name)
        return target is not None and target.rsplit(".", 1)[0] in fp8.names

    return fp8_weights(weights, fp8.format, fp8.quantized, keeps)


def load_tokenizer(path: Path) -> Tokenizer | None:
    """tokenizer.json through the `tokenizers` library; None if the folder has none
    (such a model can still be driven with token ids)."""
    file = path / "tokenizer.json"
    return Tokenizer.from_file(str(file)) if file.is_file() else None
