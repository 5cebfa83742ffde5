"""The scheduler's decisions: chunks of long prompts share steps with decodes,
the newest sequence is preempted first, and nothing is ever dropped."""

from __future__ import annotations

import torch

from engine.kv.block_manager import BlockManager
from engine.outputs import EngineCoreEventType, ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.stats import EngineStats


def make(num_blocks: int, budget: int, block_size: int = 4) -> Scheduler:
    return Scheduler(8, budget, BlockManager(num_blocks, block_size), EngineStats())


def run_step(sched: Scheduler, new_token: int = 7) -> list[tuple[str, int]]:
    """One step as the engine does it, with a model that always samples ``new_token``."""
    out = sched.schedule()
    sampled = [item.req_id for item in out.scheduled if item.samples]
    tokens = torch.full((len(sampled),), new_token)
    sched.update_from_output(out, ModelRunnerOutput(sampled, tokens))
    return [(item.req_id, item.num_new_tokens) for item in out.scheduled]


def test_long_prompt_is_chunked_alongside_decodes() -> None:
    sched = make(num_blocks=64, budget=8)
    short = Sequence("short", [1, 2, 3], SamplingParams())
    sched.add(short)
    assert run_step(sched) == [("short", 3)]
    sched.add(Sequence("long", list(range(20)), SamplingParams()))
    steps = [run_step(sched) for _ in range(3)]
    # Each step: one decode token for "short", the rest of the budget for "long".
    assert steps == [
        [("short", 1), ("long", 7)],
        [("short", 1), ("long", 7)],
        [("short", 1), ("long", 6)],
    ]
    assert sched.stats.partial_prefills == 2


def test_newest_is_preempted_first_and_resumes_later() -> None:
    sched = make(num_blocks=6, budget=64, block_size=4)
    seqs = [Sequence(f"s{i}", [i] * 8, SamplingParams()) for i in range(3)]
    for s in seqs:
        sched.add(s)
    run_step(sched)  # each holds 2 blocks: all 6 are used
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 3
    # The 9th token needs a third block for everyone: the newest gives its two up.
    assert run_step(sched) == [("s0", 1), ("s1", 1)]
    assert sched.stats.preemptions == 1
    assert list(sched.waiting) == [seqs[2]]
    assert seqs[2].num_computed_tokens == 0 and seqs[2].block_table == []
    assert seqs[2].token_ids == [2] * 8 + [7]  # its tokens are kept for the recompute
    # Finish the older ones; the preempted one comes back and nobody is lost.
    for _ in range(40):
        for s in list(sched.running):
            if s.num_tokens >= 14:
                sched.finish_requests([s.request_id], "length")
        if not sched.has_unfinished():
            break
        run_step(sched)
    assert not sched.has_unfinished()
    assert all(s.status is SequenceStatus.FINISHED for s in seqs)
    assert seqs[2].num_preemptions >= 1


def test_a_preempted_sequence_goes_back_in_front_of_those_waiting() -> None:
    sched = make(num_blocks=4, budget=64, block_size=4)
    s0, s1, s2 = (Sequence(f"s{i}", [i] * 8, SamplingParams()) for i in range(3))
    for s in (s0, s1, s2):
        sched.add(s)
    assert run_step(sched) == [("s0", 8), ("s1", 8)]  # s2 waits: no block is left
    assert list(sched.waiting) == [s2]
    # s0's 9th token needs a block: s1, the newest running, gives its two up and
    # queues in front of s2, which arrived after it.
    assert run_step(sched) == [("s0", 1)]
    assert list(sched.waiting) == [s1, s2]
    # s0 finishes; s1 is admitted before s2.
    sched.finish_requests(["s0"], "length")
    assert [name for name, _ in run_step(sched)][0] == "s1"


def test_events_record_what_the_scheduler_did_in_order() -> None:
    """Queued, admitted, preempted and resumed, with the step each happened in and
    an index that orders them across requests. A request's events leave with its
    next output, once; a preempted request's wait until it outputs again."""
    sched = make(num_blocks=6, budget=64, block_size=4)
    seqs = [Sequence(f"s{i}", [i] * 4, SamplingParams(max_tokens=12)) for i in range(3)]
    for s in seqs:
        sched.add(s)
    reported: dict[str, list] = {s.request_id: [] for s in seqs}
    while sched.has_unfinished():
        out = sched.schedule()
        sampled = [item.req_id for item in out.scheduled if item.samples]
        tokens = torch.full((len(sampled),), 7)
        for core in sched.update_from_output(out, ModelRunnerOutput(sampled, tokens)):
            reported[core.request_id] += core.events
    E = EngineCoreEventType
    assert [(e.type, e.step) for e in reported["s0"]] == [(E.QUEUED, 1), (E.SCHEDULED, 1)]
    events = sorted((e, name) for name, es in reported.items() for e in es)  # by index
    assert len({e.index for e, _ in events}) == len(events)  # each reported once
    assert [e.step for e, _ in events] == sorted(e.step for e, _ in events)
    # Step 6 computes everyone's 9th token, which needs a third block: the newest
    # gives way. At step 10, the 13th token needs a fourth: the next newest does.
    preempted = [(e.step, name, e.num_tokens) for e, name in events if e.type is E.PREEMPTED]
    assert preempted[:2] == [(6, "s2", 9), (10, "s1", 13)]
    for name in ("s1", "s2"):  # each comes back after it gave way, and finishes
        kinds = [e.type for e in reported[name]]
        assert kinds[:3] == [E.QUEUED, E.SCHEDULED, E.PREEMPTED] and E.SCHEDULED in kinds[3:]
    assert all(s.events == [] for s in seqs)


def test_prompts_admitted_together_share_their_common_prefix() -> None:
    """Three prompts with the same 10-token prefix arrive together: the first
    computes its two full prefix blocks, the others share them in the same step
    (every layer stores the batch's keys before any attention reads them)."""
    sched = make(num_blocks=64, budget=64, block_size=4)
    prefix = list(range(10, 20))
    seqs = [Sequence(f"p{i}", prefix + [i, i], SamplingParams()) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert run_step(sched) == [("p0", 12), ("p1", 4), ("p2", 4)]
    assert seqs[1].block_table[:2] == seqs[2].block_table[:2] == seqs[0].block_table[:2]
    assert sched.stats.prefix_cache_hit_tokens == 2 * 8


def test_a_chunk_publishes_only_the_blocks_it_fills() -> None:
    """A prompt split by the token budget offers, when scheduled, the blocks its
    chunk fills: 14 of 24 tokens fill 3 blocks of 4, not the 4th."""
    sched = make(num_blocks=64, budget=14, block_size=4)
    seq = Sequence("a", list(range(30, 54)), SamplingParams())
    sched.add(seq)
    sched.schedule()
    assert len(seq.block_hashes) == 3
    assert len(sched.block_manager.cached_blocks) == 3


def test_async_scheduling_never_publishes_a_placeholder() -> None:
    """With one-step-ahead scheduling the token a decode feeds in may still be a
    placeholder when its step is scheduled: only prompt blocks are published
    then; the block it completes is published once the real token is in place."""
    from engine.sched.async_scheduler import AsyncScheduler

    sched = AsyncScheduler(8, 64, BlockManager(64, 4), EngineStats())
    seq = Sequence("a", [5, 6, 7, 8, 9, 10, 11], SamplingParams(max_tokens=8))
    sched.add(seq)
    first = sched.schedule()  # the 7-token prompt: one full block
    second = sched.schedule()  # the placeholder at position 7 fills block 2
    assert len(seq.block_hashes) == 1
    for out, token in ((first, 12), (second, 13)):
        sampled = [item.req_id for item in out.scheduled if item.samples]
        sched.update_from_output(out, ModelRunnerOutput(sampled, torch.full((1,), token)))
    assert seq.token_ids[7] == 12 and len(seq.block_hashes) == 2
    assert sched.block_manager.blocks[seq.block_table[1]].token_ids == (9, 10, 11, 12)
