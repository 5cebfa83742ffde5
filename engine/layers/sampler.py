"""Choosing the next token from logits: greedy, or sampled after temperature,
top-k, top-p and min-p, with a random stream per request.

A request's random draws depend only on its seed and on how many tokens it has
generated, never on which other requests share the batch or on whether it was
preempted and recomputed. That is what makes seeded sampling reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams

_MASK64 = (1 << 63) - 1


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    step: int  # how many tokens this request has generated so far


def request_generator(seed: int, step: int, device: torch.device) -> torch.Generator:
    """A counter-based stream: token ``step`` of a request seeded ``seed`` always
    sees the same random numbers, whatever else runs in the batch."""
    mixed = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) & _MASK64
    return torch.Generator(device=device).manual_seed(mixed)


def filter_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p, for one row of logits."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= p.top_p  # keep the token that crosses
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    if p.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """One token per row. Greedy rows take the argmax in one batched call;
        the rest draw from their own stream with the exponential race:
        argmax(p / E) with E ~ Exp(1) picks token i with probability p_i."""
        tokens = logits.argmax(dim=-1).tolist()
        for i, row in enumerate(rows):
            if row.params.greedy:
                continue
            probs = filter_logits(logits[i].float(), row.params).softmax(-1)
            gen = request_generator(row.seed, row.step, logits.device)
            race = torch.empty_like(probs).exponential_(generator=gen)
            tokens[i] = int((probs / race).argmax())
        return tokens

    @staticmethod
    def logprobs(logits: torch.Tensor, tokens: list[int], rows: list[SamplingRow]) -> list:
        """For rows that asked: the chosen token's logprob and the top-n, from
        the model's raw distribution (before temperature and filters)."""
        result: list[dict[int, float] | None] = [None] * len(rows)
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        if not wanted:
            return result
        logp = torch.log_softmax(logits[wanted].float(), dim=-1)
        for j, i in enumerate(wanted):
            n = rows[i].params.logprobs
            top = torch.topk(logp[j], n) if n else None
            entry = {} if top is None else dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[tokens[i]] = float(logp[j, tokens[i]])
            result[i] = entry
        return result
