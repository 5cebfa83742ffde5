"""Speculative decoding's share of the model runner: every proposer runs here,
after a step's sampling, and its drafts go back to the scheduler with the
step's tokens (ModelRunnerOutput.draft_token_ids). The scheduler knows drafts
only as those ids; it cuts them and schedules them with the request's next
token, and this runner checks them (DraftCheck).

Two kinds of proposer. One that reads the requests' tokens (prompt lookup, a
draft model: TokenDrafts) runs on rank 0, which has the step's tokens. One that
reads the step's hidden states (DeepSeek's MTP module: HiddenDrafts) runs on
every rank, since under expert parallelism every rank runs its MoE layers."""

from __future__ import annotations

from functools import partial
from typing import Protocol

import torch

from engine.distributed.expert_parallel import broadcast_from_rank0
from engine.outputs import ModelRunnerOutput
from engine.runner.input_batch import CachedRequestState, ModelInput, PreparedStep
from engine.sample.rejection_sampler import DraftCheck, SampledDrafts
from engine.sample.sampler import RandomRows, SamplingRow
from engine.spec_decode.mtp import MTPProposer
from engine.spec_decode.proposer import NO_DRAFT, DraftProposer, DraftRequest
from engine.utils import to_device


class Drafter(Protocol):
    """A proposer as the model runner drives it."""

    reads_hidden: bool  # whether propose() reads the step's hidden states

    def propose(
        self, step: PreparedStep, output: ModelRunnerOutput | None, hidden: torch.Tensor | None
    ) -> None:
        """After sampling: put the drafts after each sampled request's newest
        token into ``output`` (rank 0's; None on another rank). ``hidden``: the
        step's last hidden states, every position's, if ``reads_hidden``; else None."""
        ...

    def probs(self, req_id: str) -> torch.Tensor | None:
        """The q its latest drafts were drawn from ([drafts, vocab]); None: one-hot."""
        ...

    def forget(self, req_ids: list[str]) -> None: ...


class TokenDrafts:
    """A proposer that reads each request's tokens (n-gram, draft model), kept
    here as DraftRequests, grown by each step's accepted tokens."""

    reads_hidden = False

    def __init__(self, proposer: DraftProposer, states: dict[str, CachedRequestState]) -> None:
        """``states``: the runner's requests (InputBatch.requests), for a new one's prompt."""
        self.proposer, self.states = proposer, states
        self.reqs: dict[str, DraftRequest] = {}
        self.q: dict[str, torch.Tensor] = {}  # by request id: its latest drafts' q, if drawn

    def propose(
        self, step: PreparedStep, output: ModelRunnerOutput | None, hidden: torch.Tensor | None
    ) -> None:
        if output is None:  # another rank: rank 0's drafts are the step's
            return
        reqs = []
        for req_id, row in zip(output.req_ids, output.token_rows()):  # the step's wait
            req = self.reqs.get(req_id) or self._start(req_id)
            req.token_ids += row.token_ids
            reqs.append(req)
        drafts = self.proposer.propose(reqs)
        picked = [drafts.get(req_id, NO_DRAFT) for req_id in output.req_ids]
        output.draft_token_ids = [d.token_ids for d in picked]
        output.draft_confidence = [d.confidence for d in picked]
        for req_id, d in zip(output.req_ids, picked):
            self.q.pop(req_id, None)
            if d.probs is not None:
                self.q[req_id] = d.probs

    def _start(self, req_id: str) -> DraftRequest:
        state = self.states[req_id]
        tokens = list(state.prompt_token_ids)
        req = DraftRequest(req_id, state.sampling_params, state.seed, len(tokens), tokens)
        self.reqs[req_id] = req
        return req

    def probs(self, req_id: str) -> torch.Tensor | None:
        return self.q.get(req_id)

    def forget(self, req_ids: list[str]) -> None:
        for req_id in req_ids:
            self.reqs.pop(req_id, None)
            self.q.pop(req_id, None)
        self.proposer.forget(req_ids)


class HiddenDrafts:
    """DeepSeek's MTP module (spec_decode/mtp.py), which drafts from the step's
    hidden states, on every rank, from rank 0's tokens."""

    reads_hidden = True

    def __init__(self, proposer: MTPProposer, expert_parallel_size: int) -> None:
        self.proposer, self.ep = proposer, expert_parallel_size

    def propose(
        self, step: PreparedStep, output: ModelRunnerOutput | None, hidden: torch.Tensor | None
    ) -> None:
        assert hidden is not None  # reads_hidden: the runner kept them
        tokens, accepted = self._from_rank0(step, output, hidden.device)
        batch = step.batch
        drafts = self.proposer.propose(batch.items, batch.input_ids, hidden, tokens, accepted)
        if output is not None:
            output.draft_token_ids = drafts

    def _from_rank0(
        self, step: PreparedStep, output: ModelRunnerOutput | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's sampled tokens and accepted drafts (None: no drafts), on every
        rank: under expert parallelism every rank runs the MTP module's MoE layers,
        so every rank drafts from rank 0's tokens, which it sends the others."""
        if self.ep == 1:
            return output.sampled_token_ids, output.num_accepted
        batch = step.batch
        if output is None:  # another rank: room for what rank 0 sends
            empty = partial(torch.empty, dtype=torch.int64, device=device)
            accepted = None if step.drafts is None else empty(len(batch.req_ids))
            output = ModelRunnerOutput(batch.req_ids, empty(sum(batch.num_positions())))
            output.num_accepted = accepted
        tokens = broadcast_from_rank0(output.sampled_token_ids)
        if output.num_accepted is None:
            return tokens, None
        return tokens, broadcast_from_rank0(output.num_accepted)

    def probs(self, req_id: str) -> torch.Tensor | None:
        return None  # its drafts are the module's argmax: one-hot

    def forget(self, req_ids: list[str]) -> None:
        self.proposer.forget(req_ids)


def draft_check(
    batch: ModelInput, rows: list[SamplingRow], drafter: Drafter, vocab: int, device: torch.device
) -> DraftCheck | None:
    """What acceptance compares, on the device; None without drafts. ``rows``:
    the step's sampling rows, whose settings the rejection sampler's p needs."""
    width = max((len(d) for d in batch.drafts), default=0)
    if width == 0:
        return None
    drafts, check_rows, start = [], [], 0
    for n, d in zip(batch.num_positions(), batch.drafts):
        drafts.append(d + [-1] * (width - len(d)))
        check_rows.append([start + min(j, n - 1) for j in range(width)])
        start += n
    check = DraftCheck(
        to_device(drafts, torch.int64, device), to_device(check_rows, torch.int64, device)
    )
    check.sampled = sampled_drafts(batch, rows, check_rows, drafter, vocab, device)
    return check


def sampled_drafts(
    batch: ModelInput,
    rows: list[SamplingRow],
    check_rows: list[list[int]],
    drafter: Drafter,
    vocab: int,
    device: torch.device,
) -> SampledDrafts | None:
    """The drafts with a q of the requests that draw (a greedy one's strict
    match is already the rejection rule); None if there are none."""
    first_row = [check[0] for check in check_rows]  # each request's first sampled row
    qs = [drafter.probs(req_id) for req_id in batch.req_ids]
    picked = [i for i, q in enumerate(qs) if q is not None and not rows[first_row[i]].params.greedy]
    if not picked:
        return None
    width = len(check_rows[0])
    probs = torch.zeros(len(picked), width, vocab, device=device)
    for r, i in enumerate(picked):
        n = len(batch.drafts[i])
        probs[r, :n] = qs[i][:n].to(device, torch.float32)
    positions = [rows[j] for i in picked for j in check_rows[i]]
    return SampledDrafts(
        index=to_device(picked, torch.int64, device),
        rows=to_device([check_rows[i] for i in picked], torch.int64, device),
        drafts=to_device([pad(batch.drafts[i], width) for i in picked], torch.int64, device),
        num_drafts=to_device([len(batch.drafts[i]) for i in picked], torch.int64, device),
        probs=probs,
        filters=RandomRows.from_rows(positions, vocab, device),
    )


def pad(drafts: list[int], width: int) -> list[int]:
    """A request's drafts padded with token 0 to ``width`` (its count masks the rest)."""
    return drafts + [0] * (width - len(drafts))
