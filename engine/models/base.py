"""What the engine asks of a model, declared rather than probed.

Every architecture subclasses ``CausalLM``: the model runner reads these
capabilities as plain attributes, and a model that has no routed experts says
so by returning none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, cast

import torch
from torch import nn

if TYPE_CHECKING:
    from engine.kv.kv_cache import CachedLayer
    from engine.layers.moe import Experts
    from engine.layers.quantization.fp8_loading import Fp8Layers


class CausalLM(nn.Module):
    supports_compile: ClassVar[bool] = False  # its decode step can run through torch.compile
    supports_packed_linears: ClassVar[bool] = False  # nothing reads its linears' weights
    supports_cuda_graphs: ClassVar[bool] = True  # its decode step can be captured
    # Its attention reads block tables by position, a window's holes (-1) left in,
    # with each sequence's real length as its context (DeepSeek-V4).
    reads_block_holes: ClassVar[bool] = False

    # Linear layers the model reads by their weight rather than by calling them
    # (MLA's kv_b_proj): an FP8 checkpoint's copy is dequantized at load.
    plain_linears: ClassVar[tuple[str, ...]] = ()
    # Linear layers weight-only int8 and int4 leave as they are, besides the output
    # head named lm_head and the plain ones: DeepSeek-V4's head, and its wo_a, which
    # it reads by weight a group of rows at a time (an FP8 wo_a has a path of its own).
    unquantized_linears: ClassVar[tuple[str, ...]] = ()
    fp8: Fp8Layers | None = None  # its FP8 layers and their format, set at load

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_target(self, name: str) -> str | None:
        """The parameter a checkpoint tensor fills (a fused or stacked one may take
        several tensors; None: one the model does not load): what loading a
        quantized checkpoint asks of the model."""
        return name

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def attention_layers(self) -> list[nn.Module]:
        """Every layer the KV pool gives a paged cache, in the order it allocates
        them. Layers that serve only a draft (DeepSeek's MTP) are not among them."""
        raise NotImplementedError

    def kv_cache_layers(self, block_size: int) -> list[CachedLayer]:
        """What the KV pool sizes and binds, in order, for blocks of ``block_size``
        tokens: the attention layers, or one object standing for them all
        (DeepSeek-V4's pages, kv/compressed_cache.py)."""
        return cast("list[CachedLayer]", self.attention_layers())

    def experts(self) -> list[Experts]:
        """The routed experts of every MoE layer; none for a dense model."""
        return []

    def opaque_layers(self) -> list[nn.Module]:
        """What a compiled forward pass calls as opaque operators (layers/opaque.py):
        the attention layers, then the routed experts of every MoE layer."""
        return [*self.attention_layers(), *self.experts()]

    # A DeepSeek model's multi-token prediction module, as the MTP drafter uses it
    # (engine/spec_decode/mtp.py). Models without one keep these defaults.

    def has_mtp(self) -> bool:
        """Whether the model holds an MTP module with its weights, to draft with."""
        return False

    def mtp_attention_layers(self) -> list[CachedLayer]:
        """What the MTP module caches, for the pool to size and bind beside
        kv_cache_layers; nothing for a model without one."""
        return []

    def mtp_hidden_states(
        self, positions: torch.Tensor, hidden: torch.Tensor, next_token_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The module over rows of (forward's output at position i, token i+1): the
        state draft_logits turns into token i+2's logits, and the module's output
        that a further draft starts from, shaped as ``hidden``."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP module")

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Logits of mtp_hidden_states' first result."""
        return self.compute_logits(normed)


class DecoderLayer(nn.Module):
    """One pre-norm transformer layer. Subclasses build ``self_attn``, ``mlp`` and
    the two norms; the residual stream passes through the fused add-and-norm."""

    self_attn: nn.Module
    mlp: nn.Module
    input_layernorm: nn.Module
    post_attention_layernorm: nn.Module

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


# Weight loading: the checks every architecture makes the same way.


def never_loaded(name: str, tie_word_embeddings: bool) -> bool:
    """Checkpoint tensors the model recomputes or shares instead of reading."""
    return "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tie_word_embeddings)


def copy_checked(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
    if dest.shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)}, model expects {tuple(dest.shape)}"
        )
    dest.copy_(tensor)


def check_complete(missing: list[str]) -> None:
    """Refuse a checkpoint that left parameters unfilled, naming the first few."""
    if missing:
        raise ValueError(
            f"checkpoint lacks weights for: {', '.join(missing[:8])}"
            + (" ..." if len(missing) > 8 else "")
        )
