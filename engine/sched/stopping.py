"""When a request stops: at an end-of-sequence or stop token (once it has
min_tokens), when its grammar is complete, or at its max_tokens or the
model's length. Stop strings are the front end's (core/output_processor.py)."""

from __future__ import annotations

from collections.abc import Collection

from engine.outputs import FinishReason
from engine.sequence import Sequence


def stop_reason(
    seq: Sequence, token: int, eos_token_ids: Collection[int], max_model_len: int | None
) -> FinishReason | None:
    """Why ``seq`` stops at its newest token ``token``; None: it goes on."""
    p = seq.params
    stop_token = (token in eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids
    if stop_token and seq.num_output_tokens >= p.min_tokens:  # held back before (vLLM)
        return FinishReason.STOP
    if seq.structured_output is not None and seq.structured_output.is_terminated():
        return FinishReason.STOP  # the grammar is complete
    return FinishReason.LENGTH if length_reached(seq, max_model_len) else None


def length_reached(seq: Sequence, max_model_len: int | None) -> bool:
    """Has the sequence as many tokens as it may have: its max_tokens, or the model's?"""
    too_long = max_model_len is not None and seq.num_tokens >= max_model_len
    return seq.num_output_tokens >= seq.params.max_tokens or too_long
