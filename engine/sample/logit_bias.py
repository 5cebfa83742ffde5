"""Additions to single logits: a request's ``logit_bias``, and the -inf that
holds back its stop tokens (EOS and ``stop_token_ids``) until it has
``min_tokens`` output tokens, as vLLM's LogitBiasLogitsProcessor and
MinTokensLogitsProcessor do. Both are sparse: a few (row, token) pairs, so one
index_put on the device serves the batch."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.utils import to_device


@dataclass
class LogitBias:
    rows: torch.Tensor  # [pairs] int64 indices into the batch
    token_ids: torch.Tensor  # [pairs] int64
    values: torch.Tensor  # [pairs] float32, added to the logit; -inf bans the token

    @classmethod
    def from_rows(
        cls,
        rows: list[tuple[int, SamplingParams, int]],
        eos_token_ids: Collection[int],
        vocab_size: int,
        device: torch.device,
    ) -> LogitBias | None:
        """From (batch index, settings, output position) of every row; None when
        no row has a bias or a stop token to hold back."""
        pairs: list[tuple[int, int, float]] = []
        for i, p, step in rows:
            if p.logit_bias:
                pairs += [(i, t, b) for t, b in p.logit_bias.items()]
            if step < p.min_tokens:
                pairs += [(i, t, float("-inf")) for t in held_back(p, eos_token_ids, vocab_size)]
        if not pairs:
            return None
        return cls(
            rows=to_device([i for i, _, _ in pairs], torch.int64, device),
            token_ids=to_device([t for _, t, _ in pairs], torch.int64, device),
            values=to_device([v for _, _, v in pairs], torch.float32, device),
        )


def held_back(p: SamplingParams, eos_token_ids: Collection[int], vocab_size: int) -> set[int]:
    """The tokens min_tokens holds back: the stop tokens, and EOS unless ignored."""
    stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    return {t for t in stops if 0 <= t < vocab_size}


def apply_logit_bias(logits: torch.Tensor, bias: LogitBias) -> torch.Tensor:
    """A copy of ``logits`` with each pair's value added. A pair may come twice (a
    bias on a token held back): the sum is -inf whatever the order."""
    out = logits.clone()
    out.index_put_((bias.rows, bias.token_ids), bias.values, accumulate=True)
    return out
