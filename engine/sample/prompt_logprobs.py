"""Prompt logprobs (SamplingParams.prompt_logprobs, as vLLM defines them): for
every prompt token after the first, its logprob and the top k, from the model's
own distribution (no temperature, no mask) given the prompt before it.

The hidden state at position p scores the token at p + 1. So a request that asks
gets logits at every position of its prompt chunks, not only at the last: the
positions 0 .. P - 2 of a P-token prompt score its tokens 1 .. P - 1. A chunk's
last position scores the next chunk's first token, so nothing is lost at a
border between chunks. Each entry is computed once, at its position: a request
preempted and recomputed computes none again (PromptLogprobs.scheduled), and
the whole list goes out with the request's first sampled token.

The model runner asks for these rows only while some request still waits for
its list (InputBatch.pending_prompt_logprobs); a step without one runs as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.outputs import LogprobsTensors
from engine.scheduler_output import ScheduledRequest
from engine.utils import to_device


@dataclass
class PromptLogprobs:
    """One request's list, filled chunk by chunk on the device: row j is prompt
    token j + 1, its own id and logprob in column 0, then its top k."""

    prompt_token_ids: list[int]
    k: int
    token_ids: torch.Tensor  # [P - 1, 1 + k] int64
    logprobs: torch.Tensor  # [P - 1, 1 + k] float32
    scheduled: int = 0  # rows 0 .. scheduled - 1 belong to steps already prepared
    sent: bool = False  # handed on with the first sampled token

    @classmethod
    def empty(cls, prompt: list[int], k: int, device: torch.device) -> PromptLogprobs:
        """Room for the list; ``k`` no more than the vocabulary."""
        shape = (len(prompt) - 1, 1 + k)
        return cls(
            list(prompt),
            k,
            torch.zeros(shape, dtype=torch.int64, device=device),
            torch.zeros(shape, dtype=torch.float32, device=device),
        )

    @property
    def num_rows(self) -> int:
        return len(self.prompt_token_ids) - 1

    def tensors(self) -> LogprobsTensors:
        return LogprobsTensors(self.token_ids, self.logprobs)


@dataclass
class PromptRows:
    """A step's positions whose logits score prompt tokens. Their rows come after
    the sampled rows in the step's logits_indices."""

    rows: list[int] = field(default_factory=list)  # indices into the step's hidden states
    targets: list[int] = field(default_factory=list)  # the prompt token each row scores
    spans: list[tuple[PromptLogprobs, int, int]] = field(default_factory=list)  # first, count
    due: dict[str, PromptLogprobs] = field(default_factory=dict)  # sent with this step's token

    @property
    def max_k(self) -> int:
        return max((buf.k for buf, _, _ in self.spans), default=0)


def prompt_rows(
    items: list[ScheduledRequest], states: dict[str, PromptLogprobs | None]
) -> PromptRows | None:
    """The rows of the flattened batch (``items`` in the batch's order) that score
    prompt tokens not yet scheduled, and the lists due this step; None if neither.
    Marks those rows scheduled: a step, once prepared, runs."""
    out, offset = PromptRows(), 0
    for item in items:
        buf = states.get(item.req_id)
        if buf is not None and not buf.sent:
            start = item.num_computed_tokens
            first = max(start, buf.scheduled)
            end = min(start + item.num_new_tokens, buf.num_rows)
            if first < end:
                out.rows += range(offset + first - start, offset + end - start)
                out.targets += buf.prompt_token_ids[first + 1 : end + 1]
                out.spans.append((buf, first, end - first))
                buf.scheduled = end
            if item.samples:  # its prompt is whole: every row is scheduled by now
                out.due[item.req_id] = buf
                buf.sent = True
        offset += item.num_new_tokens
    return out if out.rows or out.due else None


def fill_prompt_logprobs(
    prompt: PromptRows, logits: torch.Tensor
) -> dict[str, LogprobsTensors] | None:
    """Write each row's entry at its position; the lists due this step, or None."""
    if prompt.rows:
        logp = torch.log_softmax(logits.float(), dim=-1)
        targets = to_device(prompt.targets, torch.int64, logits.device)
        chosen = logp.gather(1, targets[:, None])
        top = logp.topk(prompt.max_k, dim=-1)
        i = 0
        for buf, first, n in prompt.spans:
            k = buf.k
            buf.token_ids[first : first + n, 0] = targets[i : i + n]
            buf.logprobs[first : first + n, 0] = chosen[i : i + n, 0]
            buf.token_ids[first : first + n, 1 : 1 + k] = top.indices[i : i + n, :k]
            buf.logprobs[first : first + n, 1 : 1 + k] = top.values[i : i + n, :k]
            i += n
    if not prompt.due:
        return None
    return {req_id: buf.tensors() for req_id, buf in prompt.due.items()}
