"""Speculative decoding's share of the scheduler: the drafts the model runner's
proposer made after each request's newest token come back with the step's
tokens (keep_drafts), wait on the request for its next step, and are cut to
the length a verify-length schedule gives each (proposed). The scheduler then
cuts them to its token budget and the request's limits (cut_drafts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from engine.outputs import ModelRunnerOutput
from engine.sequence import Sequence
from engine.spec_decode.proposer import NO_DRAFT, Draft
from engine.spec_decode.verify_length import ConfidenceSchedule, StepShape
from engine.stats import SpecDecodeStats


def keep_drafts(requests: Mapping[str, Sequence], runner_output: ModelRunnerOutput) -> None:
    """Keep the drafts the model runner made after each unfinished request's
    newest token, with the proposer's confidence in them, for its next step."""
    if runner_output.draft_token_ids is None:
        return
    confidence = runner_output.draft_confidence or [None] * len(runner_output.req_ids)
    for req_id, drafts, sure in zip(runner_output.req_ids, runner_output.draft_rows(), confidence):
        if (seq := requests.get(req_id)) is not None:
            seq.spec_token_ids, seq.spec_confidence = drafts, sure
            seq.spec_at = seq.num_tokens


def proposed(
    running: list[Sequence],
    num_new_tokens: Callable[[Sequence], int],
    schedule: ConfidenceSchedule | None,
    budget: int,
) -> dict[str, Draft]:
    """The drafts of the sequences about to decode one token, made after their
    newest token (a sequence whose newest token changed since finds its drafts
    stale), each cut to the length the verify schedule gives it, if there is one."""
    drafts = {
        s.request_id: Draft(s.spec_token_ids, None, s.spec_confidence)
        for s in running
        if s.spec_token_ids and s.spec_at == s.num_tokens and num_new_tokens(s) == 1
    }
    if schedule is None or not drafts:
        return drafts
    pending = [num_new_tokens(seq) for seq in running]
    shape = StepShape(min(sum(pending), budget), sum(1 for n in pending if n == 1))
    return schedule.cut(drafts, shape)


def cut_drafts(
    seq: Sequence,
    n: int,
    budget: int,
    drafts: Draft,
    max_model_len: int | None,
    stats: SpecDecodeStats,
) -> Draft:
    """The drafts ``seq`` checks this step, after its ``n`` new tokens: only
    after its newest token, within the token budget and the model's length,
    and no more than would reach max_tokens with the token sampled after them.
    Under a grammar, only the drafts it accepts (each verified position then
    gets its own mask)."""
    if not drafts or seq.num_computed_tokens + n != seq.num_tokens:
        return NO_DRAFT
    if (grammar := seq.structured_output) is not None:
        grammar.catch_up(seq.output_token_ids)
        drafts = drafts.head(grammar.draft_prefix(drafts.token_ids))
    room = min(budget - n, seq.params.max_tokens - seq.num_output_tokens - 1)
    if max_model_len is not None:
        room = min(room, max_model_len - seq.num_tokens - 1)
    drafts = drafts.head(max(room, 0))
    stats.observe_chosen(len(drafts))
    return drafts
