"""A draft model: a small model with the target's vocabulary guesses the next
k tokens, one forward pass each, and the target checks them all in one.

The draft is a model runner of its own, with its own paged KV cache and block
tables (draft_kv.py), driven by the target's runner (runner/drafting.py): after
each step, the requests that sampled catch up (the draft feeds the tokens it has
not seen, after rolling back its wrong guesses), then it guesses k tokens in k
passes over the whole batch. A greedy request's guesses are the draft's argmax, and
the target keeps them by strict match. A sampled request's are drawn from q,
the draft's distribution after the request's own temperature, top-k, top-p and
min-p, and travel with their q to the rejection sampler, which keeps the
target's distribution whatever q is. Every guess also carries the draft's
confidence in it (its probability under q), which a verify-length schedule
can spend (verify_length.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.models.loader import load_tokenizer
from engine.sample.rejection_sampler import target_probs
from engine.sample.sampler import RandomRows, SamplingRow, argmax, exponential_noise
from engine.scheduler_output import NewRequestData, ScheduledRequest, SchedulerOutput
from engine.sequence import Sequence
from engine.spec_decode.draft_kv import DraftKV
from engine.spec_decode.proposer import Draft, DraftRequest
from engine.utils import cdiv

# The draft's race draws token ids 3V..4V of the request's stream at each output
# position: the ordinary draw has 0..V, the rejection sampler V..2V and 2V.
DRAFT_STREAM = 3


class DraftRunner(Protocol):
    """What the draft needs of its model runner (runner/model_runner.py)."""

    block_size: int
    max_model_len: int
    num_kv_blocks: int
    vocab_size: int

    def logits_for(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """One forward pass over ``out``: the sampled rows' logits, and whose they are."""
        ...


@dataclasses.dataclass
class Lane:
    """One request's share of a proposal: its shadow in the draft's cache, how
    many guesses it wants, and those made so far."""

    seq: DraftRequest
    shadow: Sequence
    want: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    probs: list[torch.Tensor] = dataclasses.field(default_factory=list)
    confidence: list[float] = dataclasses.field(default_factory=list)

    def draft(self) -> Draft:
        probs = torch.stack(self.probs) if self.probs else None
        return Draft(self.tokens, probs, tuple(self.confidence))


class DraftModelProposer:
    def __init__(self, runner: DraftRunner, k: int, max_model_len: int) -> None:
        self.runner, self.k = runner, k
        self.max_model_len = min(max_model_len, runner.max_model_len)
        self.kv = DraftKV(runner.num_kv_blocks, runner.block_size)
        self.vocab_size = runner.vocab_size
        self.known: set[str] = set()  # requests the draft's runner holds settings for
        self.ended: list[str] = []  # forgotten since its last step, for its runner

    @classmethod
    def from_config(
        cls,
        target: EngineConfig,
        num_blocks: int,
        max_model_len: int,
        new_runner: Callable[[EngineConfig], DraftRunner],
    ) -> DraftModelProposer:
        """The draft of ``target``'s speculative_config, with a cache of
        ``num_blocks`` (the target's) plus room for every request's guesses,
        run by ``new_runner(config)`` (the target's runner passes ModelRunner)."""
        config = draft_engine_config(target, num_blocks)
        check_same_vocabulary(target, config)
        k = target.speculative_config.num_speculative_tokens
        return cls(new_runner(config), k, max_model_len)

    def forget(self, req_ids: list[str]) -> None:
        self.kv.forget(req_ids)
        self.ended += [r for r in req_ids if r in self.known]
        self.known.difference_update(req_ids)

    def propose(self, seqs: list[DraftRequest]) -> dict[str, Draft]:
        busy = {seq.request_id for seq in seqs}
        lanes = []
        for seq in seqs:
            want = self._num_guesses(seq)
            shadow = self.kv.catch_up(seq, want, busy) if want > 0 else None
            if shadow is not None:
                lanes.append(Lane(seq, shadow, want))
        items = [self._item(lane, lane.shadow.num_computed_tokens) for lane in lanes]
        for j in range(max((lane.want for lane in lanes), default=0)):
            active = [lane for lane in lanes if lane.want > j]
            logits = self._forward([lane.seq for lane in active], items)
            for lane, token in zip(active, self._guess(logits, active)):
                lane.shadow.num_computed_tokens = lane.shadow.num_tokens
                if lane.want > j + 1:  # fed back for the next guess
                    self.kv.wrote(lane.shadow, token)
            items = [self._item(lane, lane.shadow.num_tokens - 1) for lane in active
                     if lane.want > j + 1]  # fmt: skip
        return {lane.seq.request_id: lane.draft() for lane in lanes}

    def _num_guesses(self, seq: DraftRequest) -> int:
        """k, or fewer where the request would reach its max_tokens or the model's
        length with the token the target samples after the guesses."""
        room = min(
            self.max_model_len - seq.num_tokens - 1,
            seq.params.max_tokens - seq.num_output_tokens - 1,
        )
        return max(0, min(self.k, room))

    def _item(self, lane: Lane, start: int) -> ScheduledRequest:
        """The shadow's tokens from ``start`` on, whose keys and values the draft computes."""
        shadow = lane.shadow
        return ScheduledRequest(
            shadow.request_id, shadow.token_ids[start:], start, (shadow.block_table,), True
        )

    def _forward(self, seqs: list[DraftRequest], items: list[ScheduledRequest]) -> torch.Tensor:
        """One pass of the draft over ``items``; its logits, a row per item, in order."""
        new = [self._new_request(seq) for seq in seqs if seq.request_id not in self.known]
        self.known.update(seq.request_id for seq in seqs)
        out = SchedulerOutput(items, new, finished_req_ids=self.ended)
        self.ended = []
        logits, req_ids = self.runner.logits_for(out)  # in the runner's order (decodes first)
        order = {req_id: i for i, req_id in enumerate(req_ids)}
        return logits[[order[item.req_id] for item in items]]

    def _new_request(self, seq: DraftRequest) -> NewRequestData:
        return NewRequestData(seq.request_id, seq.params, seq.seed, seq.num_prompt_tokens)

    def _guess(self, logits: torch.Tensor, lanes: list[Lane]) -> list[int]:
        """Each lane's next guess: the argmax for a greedy request, else a draw
        from q, from the request's stream at the guess's output position."""
        probs = logits.softmax(dim=-1)
        tokens = argmax(probs)
        rows = [SamplingRow(lane.seq.params, lane.seq.seed, output_position(lane))
                for lane in lanes]  # fmt: skip
        q = None
        if (drawn := RandomRows.from_rows(rows, self.vocab_size, logits.device)) is not None:
            q = target_probs(logits[drawn.rows], drawn)
            ids = torch.arange(DRAFT_STREAM * self.vocab_size, (DRAFT_STREAM + 1) *
                               self.vocab_size, device=logits.device).expand(len(q), -1)  # fmt: skip
            noise = exponential_noise(drawn.seeds, drawn.steps, ids, self.vocab_size)
            tokens[drawn.rows] = argmax(q.div(noise))
            probs[drawn.rows] = q
        chosen = tokens.tolist()
        confidence = probs.gather(1, tokens[:, None]).squeeze(1).tolist()
        for i, lane in enumerate(lanes):
            lane.tokens.append(chosen[i])
            lane.confidence.append(confidence[i])
        if q is not None:
            for r, i in enumerate(drawn.rows.tolist()):
                lanes[i].probs.append(q[r])
        return chosen


def output_position(lane: Lane) -> int:
    """The output position of the lane's next guess: the shadow holds the
    request's tokens and the guesses fed back so far, and the guess follows."""
    return lane.shadow.num_tokens - lane.seq.num_prompt_tokens


def draft_engine_config(target: EngineConfig, num_blocks: int) -> EngineConfig:
    """The draft's engine settings: the target's device, dtype, block size and
    backend; no speculation, compilation, tracing or experts of its own; a cache
    of the target's blocks plus, per request, the blocks its guesses may need."""
    spec = target.speculative_config
    per_request = cdiv(spec.num_speculative_tokens - 1, target.block_size) + 1
    return dataclasses.replace(
        target,
        model=spec.model,
        speculative_config=None,
        num_kv_blocks=num_blocks + target.max_num_seqs * per_request,
        enable_prefix_caching=False,
        compile_decode=False,
        trace=False,
        expert_parallel_size=1,
        enable_eplb=False,
        num_redundant_experts=0,
    )


def check_same_vocabulary(target: EngineConfig, draft: EngineConfig) -> None:
    """A draft must speak the target's tokens: the same vocabulary size, and the
    same tokenizer (the same token for every id)."""
    tv, dv = target.hf_config.vocab_size, draft.hf_config.vocab_size
    if tv != dv:
        raise ValueError(
            f"speculative_config model {draft.model!r} has a vocabulary of {dv} tokens; "
            f"the target's has {tv}"
        )
    ours, theirs = load_tokenizer(Path(target.model)), load_tokenizer(Path(draft.model))
    if (ours is None) != (theirs is None) or (
        ours is not None
        and ours.get_vocab(with_added_tokens=True) != theirs.get_vocab(with_added_tokens=True)
    ):
        raise ValueError(
            f"speculative_config model {draft.model!r} has a different tokenizer from the "
            "target's: its token ids would mean other tokens"
        )
