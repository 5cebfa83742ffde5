"""Repetition, frequency and presence penalties, as vLLM and OpenAI define them,
on the rows of a batch whose requests ask for them.

For a row with output token counts ``c`` (over the tokens it has generated so
far) and ``seen`` (the tokens of its prompt or its output):

    logit / r  where seen and logit > 0;  logit * r  where seen and logit <= 0
    then  logit - frequency * c - presence * (c > 0)

The counts are built on the device from each row's output token ids, padded to
the longest row; a row's ids may still hold references to tokens a step in
flight samples (async scheduling), resolved before the penalties apply.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams
from engine.utils import to_device


@dataclass
class Penalties:
    rows: torch.Tensor  # int64 indices into the batch
    presence: torch.Tensor  # [rows] float32
    frequency: torch.Tensor  # [rows] float32
    repetition: torch.Tensor  # [rows] float32; 1 where off
    output_token_ids: torch.Tensor  # [rows, longest] int64, padded with the vocabulary size
    prompt_mask: torch.Tensor | None  # [rows, vocab] bool; None when no row has repetition

    @classmethod
    def from_rows(
        cls,
        rows: list[tuple[int, SamplingParams, list[int], torch.Tensor | None]],
        vocab_size: int,
        device: torch.device,
    ) -> Penalties | None:
        """From (batch index, settings, output token ids, prompt mask) of each row
        that has a penalty; None when there is none."""
        if not rows:
            return None
        longest = max(len(ids) for _, _, ids, _ in rows)
        padded = [ids + [vocab_size] * (longest - len(ids)) for _, _, ids, _ in rows]
        params = [p for _, p, _, _ in rows]
        prompt_mask = None
        if any(p.repetition_penalty != 1.0 for p in params):
            none = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            prompt_mask = torch.stack([none if m is None else m for _, _, _, m in rows])
        return cls(
            rows=to_device([i for i, _, _, _ in rows], torch.int64, device),
            presence=to_device([p.presence_penalty for p in params], torch.float32, device),
            frequency=to_device([p.frequency_penalty for p in params], torch.float32, device),
            repetition=to_device([p.repetition_penalty for p in params], torch.float32, device),
            output_token_ids=to_device(padded, torch.int64, device).reshape(len(rows), longest),
            prompt_mask=prompt_mask,
        )


def output_counts(output_token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab] float32: how often each token occurs in each row's ids (the
    padding, any id >= vocab_size, counts in a column that is dropped)."""
    rows = output_token_ids.shape[0]
    ids = output_token_ids.clamp(max=vocab_size)
    counts = torch.zeros(rows, vocab_size + 1, dtype=torch.float32, device=ids.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """A copy of ``logits`` with the penalised rows' logits penalised."""
    vocab = logits.shape[-1]
    picked = logits[p.rows]  # a copy
    counts = output_counts(p.output_token_ids, vocab)
    in_output = counts > 0
    if p.prompt_mask is not None:
        seen = in_output | p.prompt_mask[:, :vocab]
        scale = torch.where(seen, p.repetition[:, None], 1.0)
        picked = torch.where(picked > 0, picked / scale, picked * scale)
        # A tiny penalty can push a logit past float32's largest: keep it finite, so
        # that a row with one stays a distribution (+inf would make softmax NaN).
        picked = picked.clamp(max=torch.finfo(picked.dtype).max)
    picked = picked - p.frequency[:, None] * counts - p.presence[:, None] * in_output
    out = logits.clone()
    out[p.rows] = picked
    return out


def prompt_mask(prompt_token_ids: list[int], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[vocab] bool: the tokens a prompt holds, for its repetition penalty."""
    mask = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    mask[to_device(prompt_token_ids, torch.int64, device)] = True
    return mask
