"""The scheduler on random workloads: requests of random lengths arrive at random
steps into a cache too small for all of them, some sharing a prompt prefix, and
a model that answers each position with its own token. Every step keeps the
scheduler's books straight, and every request ends with the output it would
have had alone, however often it was preempted.

Each step: a request is in exactly one of waiting and running, with the status
that says so; a waiting one holds no block and has nothing computed; the held
and the free blocks partition the cache; the step keeps to its token budget and
its sequence limit (a budget of one token included); a request's chunks follow one another, each starting where
the last one ended, until it is preempted; and each request's preemptions, its own count, its PREEMPTED
events and the engine's total, agree, and only an admission reports cached tokens. Some requests are aborted from outside the
step, waiting or running: they end with reason "abort" and give their blocks
back, and the engine's count of finished requests leaves them out.

With drafts (the second test), a proposer in the model runner hands back after
each step a few drafts per request, some of them the model's answers and some
not: each step's drafts are exactly those handed back after the request's newest
token and cut to its budget and max_tokens, the step accepts the longest prefix
the model agrees with, the rejected drafts' blocks go back at once (a running
request holds the blocks of its computed tokens and no more), the speculative
counters equal the drafts scheduled and accepted, and every request still ends
with the output it would have had alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from engine.kv.block_manager import BlockManager
from engine.outputs import EngineCoreEvent, EngineCoreEventType, ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.scheduler_output import ScheduledRequest
from engine.sequence import Sequence, SequenceStatus
from engine.stats import EngineStats
from engine.utils import cdiv


@dataclass
class Workload:
    block_size: int
    num_blocks: int
    budget: int
    max_num_seqs: int
    # (prompt family, prompt length, max_tokens, arrival step, abort step or None)
    requests: list[tuple[int, int, int, int, int | None]]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(3, 10))
    capacity = num_blocks * block_size
    request = st.tuples(
        st.integers(0, 2),
        st.integers(1, 12),
        st.integers(1, 8),
        st.integers(0, 6),
        st.none() | st.integers(0, 12),
    ).filter(lambda r: r[1] + r[2] <= capacity)  # each fits alone
    return Workload(
        block_size,
        num_blocks,
        draw(st.integers(1, 24)),
        draw(st.integers(1, 4)),
        draw(st.lists(request, min_size=1, max_size=6)),
    )


def answer(request_id: str, position: int) -> int:
    """The model: the token a request gets at each output position, 100 and up."""
    return 100 + (hash((request_id, position)) % 50)


def check_books(sched: Scheduler, seqs: dict[str, Sequence], preempted: dict[str, int]) -> None:
    running, waiting = sched.running, list(sched.waiting)
    assert not {id(s) for s in running} & {id(s) for s in waiting}
    assert all(s.status is SequenceStatus.RUNNING for s in running)
    assert all(s.status is SequenceStatus.WAITING for s in waiting)
    assert all(s.block_table == [] and s.num_computed_tokens == 0 for s in waiting)
    held = {b for s in running for b in s.block_table}
    bm = sched.block_manager
    assert not held & set(bm.free_blocks)
    assert len(held) + bm.num_free_blocks == len(bm.blocks)
    for rid, seq in seqs.items():
        pending = sum(e.type is EngineCoreEventType.PREEMPTED for e in seq.events)
        assert seq.num_preemptions == preempted[rid] + pending, rid
    assert sched.stats.preemptions == sum(s.num_preemptions for s in seqs.values())
    assert sched.stats.generated_tokens == sum(s.num_output_tokens for s in seqs.values())


def check_event(event: EngineCoreEvent, block_size: int) -> None:
    """Only an admission finds cached tokens: whole blocks, short of the last token."""
    if event.type is EngineCoreEventType.SCHEDULED:
        cached = event.num_cached_tokens
        assert cached % block_size == 0 and cached < event.num_tokens, event
    else:
        assert event.num_cached_tokens == 0, event


def check_chunks(
    scheduled: list[ScheduledRequest],
    seqs: dict[str, Sequence],
    chunk_ends: dict[str, tuple[int, int]],
) -> None:
    """Each scheduled chunk is the request's next tokens, then its drafts: it
    starts where the step before left its computed tokens, unless the request was
    preempted in between."""
    for item in scheduled:
        seq = seqs[item.req_id]
        start, real = item.num_computed_tokens, item.num_new_tokens - item.num_drafts
        assert item.token_ids[:real] == seq.token_ids[start : start + real]
        last = chunk_ends.get(item.req_id)
        if last is not None and last[0] == seq.num_preemptions:
            assert start == last[1], (item.req_id, start, last)


def note_chunk_ends(
    scheduled: list[ScheduledRequest],
    seqs: dict[str, Sequence],
    chunk_ends: dict[str, tuple[int, int]],
) -> None:
    """Where each scheduled request's next chunk must start: its computed tokens
    after the step, accepted drafts included."""
    for item in scheduled:
        seq = seqs[item.req_id]
        chunk_ends[item.req_id] = (seq.num_preemptions, seq.num_computed_tokens)


# Four requests that outgrow six 2-token blocks: the newest is preempted twice.
CROWDED = Workload(2, 6, 24, 4, [(f, 2, 8, 0, None) for f in (0, 1, 2, 0)])


class Drafting:
    """A proposer in the model runner: after most steps, up to three drafts for
    every request that sampled, each the model's answer with probability 3/4."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.drafts = self.accepted = self.steps_with_drafts = 0

    def propose(self, rid: str, first: int) -> list[int]:
        """Drafts for output positions first, first + 1, ..."""
        n = self.rng.randint(0, 3)
        return [answer(rid, first + j) if self.rng.random() < 0.75 else 1 for j in range(n)]

    def run(self, out, seqs: dict[str, Sequence]) -> ModelRunnerOutput:
        """The step as a model would run it: each sampled request's last token and
        drafts answered in turn, its drafts accepted while they are the answers."""
        items = [item for item in out.scheduled if item.samples]
        tokens, positions, accepted, drafts = [], [], [], []
        for item in items:
            seq = seqs[item.req_id]
            first = seq.num_output_tokens  # the output position of the row's first sample
            row = [answer(item.req_id, first + j) for j in range(item.num_drafts + 1)]
            agree = 0
            while agree < item.num_drafts and item.draft_token_ids[agree] == row[agree]:
                agree += 1
            self.drafts += item.num_drafts
            self.accepted += agree
            self.steps_with_drafts += item.num_drafts > 0
            tokens += row
            positions.append(item.num_drafts + 1)
            accepted.append(agree)
            drafts.append(self.propose(item.req_id, first + agree + 1))
        return ModelRunnerOutput(
            [item.req_id for item in items],
            torch.tensor(tokens, dtype=torch.int64),
            num_positions=positions,
            num_accepted=torch.tensor(accepted, dtype=torch.int64),
            # Now and then a step hands back none: drafts kept from before are stale.
            draft_token_ids=drafts if self.rng.random() < 0.8 else None,
        )


def check_drafts(out, seqs: dict[str, Sequence], handed: dict[str, tuple[int, list[int]]]) -> None:
    """A step's drafts are those handed back after the request's newest token,
    cut only from the end, and only on a request that samples."""
    for item in out.scheduled:
        if not item.num_drafts:
            continue
        seq = seqs[item.req_id]
        at, drafts = handed[item.req_id]
        assert item.samples and at == seq.num_tokens, (item.req_id, at, seq.num_tokens)
        assert item.draft_token_ids == drafts[: item.num_drafts]
        assert item.token_ids[-item.num_drafts :] == item.draft_token_ids


def check_blocks_after_update(sched: Scheduler) -> None:
    """Rejected drafts' blocks went back: each running request holds the blocks
    of its computed tokens, no more."""
    bs = sched.block_manager.block_size
    for seq in sched.running:
        assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bs), seq.request_id


def run_workload(w: Workload, drafting: Drafting | None = None) -> None:
    sched = Scheduler(
        w.max_num_seqs, w.budget, BlockManager(w.num_blocks, w.block_size), EngineStats()
    )
    prompts = {f: [f * 1000 + i for i in range(12)] for f in range(3)}
    arrivals = sorted((r[3], i) for i, r in enumerate(w.requests))
    seqs: dict[str, Sequence] = {}
    preempted: dict[str, int] = {}
    chunk_ends: dict[str, tuple[int, int]] = {}  # request -> (preemptions, its last chunk's end)
    handed: dict[str, tuple[int, list[int]]] = {}  # request -> (its length then, drafts)
    step = 0
    while arrivals or sched.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            i = arrivals.pop(0)[1]
            family, length, max_tokens, _, _ = w.requests[i]
            seq = Sequence(f"r{i}", prompts[family][:length], SamplingParams(max_tokens=max_tokens))
            seqs[seq.request_id] = seq
            preempted[seq.request_id] = 0
            sched.add(seq)
        aborts = [f"r{i}" for i, r in enumerate(w.requests) if r[4] == step]
        sched.finish_requests([r for r in aborts if r in seqs], "abort")
        check_books(sched, seqs, preempted)
        out = sched.schedule()
        assert sum(item.num_new_tokens for item in out.scheduled) <= w.budget
        assert len(out.scheduled) <= w.max_num_seqs
        check_chunks(out.scheduled, seqs, chunk_ends)
        check_drafts(out, seqs, handed)
        if drafting is None:
            sampled = [item.req_id for item in out.scheduled if item.samples]
            tokens = [answer(r, seqs[r].num_output_tokens) for r in sampled]
            result = ModelRunnerOutput(sampled, torch.tensor(tokens, dtype=torch.int64))
        else:
            result = drafting.run(out, seqs)
        for core in sched.update_from_output(out, result):
            for event in core.events:
                check_event(event, w.block_size)
                preempted[core.request_id] += event.type is EngineCoreEventType.PREEMPTED
        note_chunk_ends(out.scheduled, seqs, chunk_ends)
        if result.draft_token_ids is not None:
            for rid, drafts in zip(result.req_ids, result.draft_rows()):
                handed[rid] = (seqs[rid].num_tokens, drafts)
        check_blocks_after_update(sched)
        check_books(sched, seqs, preempted)
        step += 1
        assert step < 500, "the workload did not drain"
    for rid, seq in seqs.items():
        want = [answer(rid, k) for k in range(seq.params.max_tokens)]
        assert seq.is_finished and rid not in sched.requests
        if seq.finish_reason == "abort":  # cut short: what it had is still right
            assert seq.output_token_ids == want[: seq.num_output_tokens], rid
        else:
            assert (seq.output_token_ids, seq.finish_reason) == (want, "length"), rid
    ended = sum(s.finish_reason == "length" for s in seqs.values())
    assert sched.stats.finished_requests == ended
    assert sched.block_manager.num_free_blocks == w.num_blocks
    if drafting is not None:
        spec = sched.stats.spec_decode
        assert spec.num_draft_tokens == drafting.drafts
        assert spec.num_accepted_tokens == drafting.accepted
        assert spec.num_drafts == drafting.steps_with_drafts


@settings(max_examples=120, deadline=None, derandomize=True)
@given(workloads())
@example(CROWDED)
def test_the_books_balance_and_every_request_ends_as_it_would_alone(w: Workload) -> None:
    run_workload(w)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(workloads(), st.integers(0, 2**16))
@example(CROWDED, 0)
def test_drafts_are_checked_rolled_back_and_counted(w: Workload, seed: int) -> None:
    run_workload(w, Drafting(seed))
