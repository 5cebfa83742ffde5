"""Quantizing a model's layers to int8 or int4 while its checkpoint streams in.

A layer is quantized as soon as every element of its weight has arrived (counted
through the model's weight_target, so that q, k and v, or an expert's halves,
each add their share), and its full-precision weight's memory is given back at
once: the load never holds the whole model in full precision. Whatever is left
when the stream ends (a layer filled some other way) is quantized after it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain

import torch
from torch import nn

from engine.layers.heap import trim_heap
from engine.layers.moe import Experts
from engine.layers.quantization.int_linear import IntExperts, int4_fits, quantized

STACKED = ("gate_up_proj", "down_proj")  # an Experts module's weights


def quantizable(
    model: nn.Module, method: str, dtype: torch.dtype, plain: tuple[str, ...] = ()
) -> tuple[dict[str, list[str]], list[str]]:
    """The layers to quantize, each with its weights' parameter names; and those
    int4's layout cannot hold (rows not in sixteens, or no group dividing a row).
    Left as they are: the output head (as vLLM leaves it), layers another shares a
    weight with, ``plain`` ones (read by weight), layers in another dtype."""
    shared = _shared(model)
    todo: dict[str, list[str]] = {}
    misfits: list[str] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(module) is Experts:
            weights = [f"{name}.{w}" for w in STACKED]
        elif type(module) is nn.Linear:
            w = module.weight
            if leaf in ("lm_head", *plain) or id(w) in shared or w.dtype != dtype:
                continue
            weights = [f"{name}.weight"]
        else:
            continue
        shapes = [model.get_parameter(w).shape[-2:] for w in weights]
        if method == "int4" and not all(int4_fits(*shape) for shape in shapes):
            misfits.append(name)
        else:
            todo[name] = weights
    return todo, misfits


def quantize_module(model: nn.Module, name: str, method: str) -> None:
    """Replace one layer by its quantized copy and give its weights' memory back
    (the load's own references to the old parameters may outlive it)."""
    parent_name, _, leaf = name.rpartition(".")
    old = model.get_submodule(name)
    new = IntExperts.replacing(old, method) if isinstance(old, Experts) else quantized(old, method)
    setattr(model.get_submodule(parent_name), leaf, new)
    for weight in STACKED if isinstance(old, Experts) else ("weight",):
        param = getattr(old, weight)
        param.data = torch.zeros((), dtype=param.dtype).expand(param.shape)  # same shape
    trim_heap()


def quantize_weights(
    model: nn.Module, method: str, dtype: torch.dtype, plain: tuple[str, ...] = ()
) -> list[str]:
    """Quantize every layer quantizable() names; returns the int4 misfits."""
    todo, misfits = quantizable(model, method, dtype, plain)
    for name in todo:
        quantize_module(model, name, method)
    return misfits


def quantize_as_loaded(
    weights: Iterable[tuple[str, torch.Tensor]],
    model: nn.Module,
    method: str,
    dtype: torch.dtype,
    target: Callable[[str], str | None],
    plain: tuple[str, ...] = (),
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, passed on; once the consumer has copied a tensor
    (it asks for the next), a layer it completed is quantized."""
    todo, _ = quantizable(model, method, dtype, plain)
    owner = {w: layer for layer, ws in todo.items() for w in ws}
    missing = {w: model.get_parameter(w).numel() for w in owner}
    last: tuple[str, int] | None = None
    for name, tensor in chain(weights, [("", None)]):
        if last is not None and last[0] in missing:
            missing[last[0]] -= last[1]
            layer = owner[last[0]]
            if all(missing[w] <= 0 for w in todo[layer]):
                quantize_module(model, layer, method)
                for w in todo[layer]:
                    del missing[w]
        if tensor is None:
            return
        yield name, tensor
        last = (target(name), tensor.numel())


def _shared(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}
