"""Choosing the next token from logits, for the whole batch at once: greedy, or
sampled after temperature, top-k, top-p and min-p, from a random stream per
request. Before either, the logits of the rows that ask are adjusted: a
grammar's mask, logit_bias and min_tokens (logit_bias.py), then the penalties
(penalties.py), in vLLM's order; a batch where no row asks skips all of it.

Every setting is a per-row tensor, so one set of tensor operations serves the
batch: no loop over rows, and no wait for the GPU. The sampled ids stay on the
device until something reads them.

A request's random draws depend only on its seed and on the output position of
the token being drawn, never on which other requests share the batch, on
whether it was preempted and recomputed, or on whether the token is sampled
after a draft in the same step or a step later. Output token ``step`` of a
request seeded ``seed`` draws one uniform number per vocabulary entry from a
hash of (seed, step, token id), computed with integer tensor ops; that is what
makes seeded sampling reproducible.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from engine.outputs import LogprobsTensors
from engine.sample.logit_bias import LogitBias, apply_logit_bias
from engine.sample.penalties import Penalties, apply_penalties
from engine.sampling_params import SamplingParams
from engine.utils import to_device

_MASK32 = 0xFFFFFFFF
_MASK63 = (1 << 63) - 1


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's index of its largest value, the first one if several tie, as
    torch.argmax gives it. On a CPU, torch.max over the last dimension finds the
    same index several times faster than torch.argmax's own kernel (a test
    compares the two on fresh inputs with ties, infinities and NaNs)."""
    return x.max(dim=-1).indices


@dataclass
class SamplingRow:
    params: SamplingParams
    seed: int
    step: int  # the output position of the token this row samples (0: the first output)
    # Only for a request with penalties: its output tokens before this row's, and
    # the tokens of its prompt (None without a repetition penalty).
    output_token_ids: list[int] | None = None
    prompt_mask: torch.Tensor | None = None


@dataclass
class RandomRows:
    """The rows that draw rather than take the argmax: their indices in the batch,
    their settings as tensors, and which filters any of them uses, known on the
    host so that unused filters cost nothing."""

    rows: torch.Tensor  # int64 indices into the batch
    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64; the vocabulary size where off
    top_p: torch.Tensor  # float32; 1 where off
    min_p: torch.Tensor  # float32; 0 where off
    seeds: torch.Tensor  # int64, below 2**63
    steps: torch.Tensor  # int64
    max_top_k: int  # the candidates top-k and top-p need: the largest k, or all
    use_top_k: bool
    use_top_p: bool
    use_min_p: bool

    @classmethod
    def from_rows(
        cls, rows: list[SamplingRow], vocab_size: int, device: torch.device
    ) -> RandomRows | None:
        """The rows that draw, as tensors; None when every row is greedy."""
        drawn = [(i, r) for i, r in enumerate(rows) if not r.params.greedy]
        if not drawn:
            return None
        params = [r.params for _, r in drawn]
        top_k = [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params]

        def tensor(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        return cls(
            rows=tensor([i for i, _ in drawn], torch.int64),
            temperature=tensor([p.temperature for p in params], torch.float32),
            top_k=tensor(top_k, torch.int64),
            top_p=tensor([p.top_p for p in params], torch.float32),
            min_p=tensor([p.min_p for p in params], torch.float32),
            seeds=tensor([r.seed & _MASK63 for _, r in drawn], torch.int64),
            steps=tensor([r.step for _, r in drawn], torch.int64),
            max_top_k=max(top_k),
            use_top_k=any(k < vocab_size for k in top_k),
            use_top_p=any(p.top_p < 1.0 for p in params),
            use_min_p=any(p.min_p > 0.0 for p in params),
        )


@dataclass
class GrammarMask:
    """The tokens a grammar allows in some rows: bit j of word w of a row of
    ``bitmask`` allows token 32 * w + j (see engine/structured_output)."""

    rows: torch.Tensor  # int64 indices into the batch
    bitmask: torch.Tensor  # [rows, ceil(vocab / 32)] int32


@dataclass
class SamplingMetadata:
    random: RandomRows | None  # None when every row is greedy
    max_num_logprobs: int | None  # the most any row asked for; None if none asked
    grammar: GrammarMask | None = None  # None when no row samples under a grammar
    logit_bias: LogitBias | None = None  # None when no row has a bias or holds back a stop
    penalties: Penalties | None = None  # None when no row has a penalty

    @classmethod
    def from_rows(
        cls,
        rows: list[SamplingRow],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Collection[int] = (),
    ) -> SamplingMetadata:
        asked = [r.params.logprobs for r in rows if r.params.logprobs is not None]
        biased = [
            (i, r.params, r.step)
            for i, r in enumerate(rows)
            if r.params.logit_bias or r.step < r.params.min_tokens
        ]
        penalised = [
            (i, r.params, r.output_token_ids or [], r.prompt_mask)
            for i, r in enumerate(rows)
            if r.params.has_penalties
        ]
        return cls(
            RandomRows.from_rows(rows, vocab_size, device),
            max(asked) if asked else None,
            logit_bias=LogitBias.from_rows(biased, eos_token_ids, vocab_size, device),
            penalties=Penalties.from_rows(penalised, vocab_size, device),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [rows] int64, on the logits' device
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """One token per row: the argmax, or, for the rows that draw, a token from
        their filtered distribution; only tokens a row's grammar allows, after
        its bias and penalties. Logprobs are the model's own, from the logits
        before any mask."""
        allowed = adjust_logits(logits, md)
        tokens = argmax(allowed)
        if (r := md.random) is not None:
            tokens[r.rows] = draw(allowed[r.rows], r)
        return SamplerOutput(tokens, compute_logprobs(logits, tokens, md.max_num_logprobs))


def adjust_logits(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits as the rows' settings change them: the grammar's mask, then
    logit_bias and min_tokens, then the penalties (vLLM's order). The model's
    own logits, not a copy, when no row asks for any."""
    if md.grammar is not None:
        logits = apply_grammar_bitmask(logits, md.grammar)
    if md.logit_bias is not None:
        logits = apply_logit_bias(logits, md.logit_bias)
    if md.penalties is not None:
        logits = apply_penalties(logits, md.penalties)
    return logits


def apply_grammar_bitmask(logits: torch.Tensor, grammar: GrammarMask) -> torch.Tensor:
    """A copy of ``logits`` with every token its row's grammar forbids at -inf.
    The mask covers the model's whole vocabulary, and the unpacking runs on the
    device, without waiting for it."""
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    unpacked = (grammar.bitmask[:, :, None] >> bits) & 1  # [rows, words, 32]
    allowed = unpacked.flatten(1)[:, : logits.shape[-1]].bool()
    out = logits.clone()
    out[grammar.rows] = logits[grammar.rows].masked_fill(~allowed, float("-inf"))
    return out


def apply_filters(logits: torch.Tensor, r: RandomRows) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Temperature, then top-k, top-p and min-p, on the rows that draw.

    Top-k and top-p need the tokens in order of likelihood, so with either one
    the result keeps only the candidates, most likely first, with the token id
    of each column; otherwise it keeps every token, in id order (ids None).
    """
    logits = logits / r.temperature[:, None]
    ids = None
    if r.use_top_k or r.use_top_p:  # one partial sort serves both
        logits, ids = logits.topk(r.max_top_k, dim=-1)
        if r.use_top_k:  # each row's k most likely tokens
            column = torch.arange(r.max_top_k, device=logits.device)
            logits = logits.masked_fill(column >= r.top_k[:, None], float("-inf"))
        if r.use_top_p:  # the smallest head whose mass reaches top_p
            probs = logits.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1).sub_(probs)
            top_p = r.top_p[:, None]
            logits = logits.masked_fill((mass_before >= top_p) & (top_p < 1.0), float("-inf"))
    if r.use_min_p:
        probs = logits.softmax(dim=-1)
        floor = r.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits, ids


def draw(logits: torch.Tensor, r: RandomRows) -> torch.Tensor:
    """The exponential race: argmax(p / E), with E ~ Exp(1) drawn independently
    for every token, picks token i with probability p_i."""
    logits, ids = apply_filters(logits, r)
    race = exponential_noise(r.seeds, r.steps, ids, logits.shape[-1])
    choice = argmax(logits.softmax(dim=-1).div_(race))
    return choice if ids is None else ids.gather(1, choice[:, None]).squeeze(1)


def mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (two multiply-xorshift rounds), in place, on an int64
    tensor of values below 2**32. Both multipliers are below 2**31, so no product
    overflows int64, and every shift sees a non-negative number."""
    x ^= x >> 16
    x *= 0x21F0AAAD
    x &= _MASK32
    x ^= x >> 15
    x *= 0x735A2D97
    x &= _MASK32
    x ^= x >> 15
    return x


_vocab_hashes: dict[tuple[int, torch.device], torch.Tensor] = {}


def token_hashes(ids: torch.Tensor | None, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A hash of each token id: of ``ids``, or of the whole vocabulary (kept)."""
    if ids is not None:
        return mix32_(ids ^ 0x5BD1E995)
    if (vocab_size, device) not in _vocab_hashes:
        every = torch.arange(vocab_size, dtype=torch.int64, device=device)
        _vocab_hashes[vocab_size, device] = mix32_(every ^ 0x5BD1E995)[None, :]
    return _vocab_hashes[vocab_size, device]


def exponential_noise(
    seeds: torch.Tensor, steps: torch.Tensor, ids: torch.Tensor | None, vocab_size: int
) -> torch.Tensor:
    """Exp(1) draws for the tokens ``ids`` ([rows, n]; None: the whole vocabulary),
    each a function of (seed, step, token id) alone."""
    key = mix32_(mix32_(seeds & _MASK32) ^ (seeds >> 32))  # both halves of the seed
    key = mix32_(key ^ (steps & _MASK32))
    bits = mix32_(key[:, None] ^ token_hashes(ids, vocab_size, seeds.device))
    # The top 23 bits, centred in their interval: uniform on (0, 1), never 0 or 1.
    # (With 24, the largest value, 1 - 2**-25, rounds to 1.0 in float32: its
    # draw would be Exp(0) = 0, and that token would win whatever its probability.)
    bits >>= 9
    uniform = bits.float().add_(0.5).mul_(2.0**-23)
    return uniform.log_().neg_()


def compute_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, max_num_logprobs: int | None
) -> LogprobsTensors | None:
    """For every row: the chosen token's logprob, then the top ``max_num_logprobs``,
    from the model's raw distribution (before temperature and filters). Each
    request keeps as many of the top ones as it asked for."""
    if max_num_logprobs is None:
        return None
    logp = torch.log_softmax(logits.float(), dim=-1)
    top = logp.topk(max_num_logprobs, dim=-1)
    chosen = logp.gather(1, tokens[:, None])
    return LogprobsTensors(
        token_ids=torch.cat([tokens[:, None], top.indices], dim=1),
        logprobs=torch.cat([chosen, top.values], dim=1),
    )
