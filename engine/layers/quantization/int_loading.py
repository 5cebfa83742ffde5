"""Quantizing a model's layers to int8 or int4 while its checkpoint streams in.

A layer is quantized as soon as every element of its weight has arrived (counted
through the model's weight_target, so that q, k and v, or an expert's halves,
each add their share), and its full-precision weight's memory is given back at
once: the load never holds the whole model in full precision. Whatever is left
when the stream ends (a layer filled some other way) is quantized after it.

An embedding table that the output head shares (tied embeddings) becomes one
int8 table, under int4 too, that both read: the head reads it whole at every
step, and llama.cpp keeps it at 8 bits for Q8_0 and 6 for Q4_0.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from itertools import chain

import torch
from torch import nn

from engine.layers.heap import free_weights
from engine.layers.moe import Experts
from engine.layers.quantization.int_linear import (
    Int8Embedding,
    Int8Linear,
    IntExperts,
    int4_fits,
    quantized,
)

STACKED = ("gate_up_proj", "down_proj")  # an Experts module's weights


def quantizable(
    model: nn.Module, method: str, dtype: torch.dtype, plain: tuple[str, ...] = ()
) -> tuple[dict[str, list[str]], list[str]]:
    """The layers to quantize, each with its weights' parameter names; and those
    int4 cannot hold (no group dividing a row).
    A tied embedding table is one of them (int8 whatever the method). Left as they
    are: an untied output head (as vLLM leaves it), any other layer sharing a
    weight, ``plain`` ones (read by weight), layers in another dtype."""
    shared = _shared(model)
    todo: dict[str, list[str]] = {}
    misfits: list[str] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if type(module) is nn.Embedding and id(module.weight) in shared:
            if module.weight.dtype == dtype:
                todo[name] = [f"{name}.weight"]
            continue
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
    old = model.get_submodule(name)
    if isinstance(old, nn.Embedding):
        return _quantize_tied(model, name, old)
    new = IntExperts.replacing(old, method) if isinstance(old, Experts) else quantized(old, method)
    _replace(model, name, new)
    free_weights(*(getattr(old, w) for w in (STACKED if isinstance(old, Experts) else ("weight",))))


def _quantize_tied(model: nn.Module, name: str, old: nn.Embedding) -> None:
    """A tied embedding table as one int8 table, and every linear layer that
    shared its weight (the output head) reading that table."""
    table = Int8Embedding(old)
    heads = [n for n, m in model.named_modules() if type(m) is nn.Linear and m.weight is old.weight]
    _replace(model, name, table)
    for head in heads:
        _replace(model, head, Int8Linear.reading(table))
    free_weights(old.weight)


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent_name), leaf, new)


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
    """The checkpoint's tensors, passed on. A layer is quantized once the consumer has
    copied its last tensor and let go of it: when it asks for the tensor after the
    next. Until then it holds that tensor, whose pages a memory-mapped checkpoint
    counts in the process's memory, as large as the layer itself."""
    todo, _ = quantizable(model, method, dtype, plain)
    owner = {w: layer for layer, ws in todo.items() for w in ws}
    missing = {w: model.get_parameter(w).numel() for w in owner}
    last: tuple[str, int] | None = None
    done: list[str] = []  # layers the consumer's last tensor completed
    for name, tensor in chain(weights, [("", None)]):
        for layer in done:
            quantize_module(model, layer, method)
        done = []
        if last is not None and last[0] in missing:
            missing[last[0]] -= last[1]
            layer = owner[last[0]]
            if all(missing[w] <= 0 for w in todo[layer]):
                done.append(layer)
                for w in todo[layer]:
                    del missing[w]
        if tensor is None:
            for layer in done:
                quantize_module(model, layer, method)
            return
        yield name, tensor
        last = (target(name), tensor.numel())


def _shared(model: nn.Module) -> set[int]:
    seen: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        seen[id(p)] = seen.get(id(p), 0) + 1
    return {k for k, n in seen.items() if n > 1}
