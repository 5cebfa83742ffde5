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

With a store behind a KV connector (the third test), finished requests save
their computed blocks, at once or later, and new ones load what the store holds,
at once or in the background, a background load now and then failing a block.
A model of what every block holds, written by steps and loads, checks that each
step reads its own prefix in every slot before its new tokens, that a save reads
blocks holding what they were computed from and still held, and that the books
count blocks held by loads and saves.

Under a sliding window with sinks (the fourth test), every slot a step reads,
its sinks and its window, is still held and holds its prefix, and the books
balance with the window's holes.
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
from engine.sched.connector_hook import ConnectorHook
from engine.sched.scheduler import Scheduler
from engine.scheduler_output import HOLE, ScheduledRequest
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
    # Blocks are held by the running, by loads in flight and by finished requests
    # whose blocks a store still saves (the connector's hook).
    loading = [seq for seq, _ in sched.kv.loading.values()]
    holders = running + loading + list(sched.kv.saving.values())
    held = {b for s in holders for b in s.block_table if b != HOLE}  # a window's holes
    # A load keeps its request waiting, or finished (aborted) until the load is done.
    assert all(
        s.status in (SequenceStatus.WAITING_FOR_KV, SequenceStatus.FINISHED) for s in loading
    )
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


def check_blocks_after_update(sched: Scheduler, out) -> None:
    """Rejected drafts' blocks went back: a running request that checked drafts
    holds the blocks of its computed tokens, no more. (Others may hold blocks
    ahead of them: a load that failed a block leaves it to be computed.)"""
    bs = sched.block_manager.block_size
    checked = {item.req_id for item in out.scheduled if item.num_drafts}
    for seq in sched.running:
        if seq.request_id in checked:
            assert len(seq.block_table) == cdiv(seq.num_computed_tokens, bs), seq.request_id


class Contents:
    """What each physical block holds, as the token prefix its last written slot
    was computed from: the model writes the slots of the tokens a step computes,
    a store's loads write whole blocks, and a step reads every slot before its
    first new token, which must hold exactly the sequence's own prefix."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched, self.bs = sched, sched.block_manager.block_size
        self.window = sched.kv_window  # (sinks, window), or None: every token is read
        self.written: dict[int, tuple[int, ...]] = {}

    def write(self, seq: Sequence, block_id: int, end: int) -> None:
        """The block now holds the slots of seq's tokens up to ``end``."""
        assert self.sched.block_manager.blocks[block_id].ref_count == 1, "a shared block written"
        self.written[block_id] = tuple(seq.token_ids[:end])

    def holds_prefix(self, seq: Sequence, num_tokens: int) -> None:
        """The slots attention reads of ``seq``'s first ``num_tokens`` tokens hold
        that prefix: a slot's content depends on the tokens up to it, and a block's
        slots are written in order, so its last write must extend the prefix read.
        Under a kv_window it reads the sinks and the window before the new tokens."""
        for p in self.read(num_tokens):
            block_id = seq.block_table[p // self.bs]
            last = self.written.get(block_id, ()) if block_id != HOLE else ()
            assert len(last) > p and last[: p + 1] == tuple(seq.token_ids[: p + 1]), (
                seq.request_id,
                p,
            )

    def read(self, num_tokens: int) -> list[int]:
        if self.window is None:
            return list(range(num_tokens))
        sinks, window = self.window
        ahead = range(min(sinks, num_tokens))
        return sorted({*ahead, *range(max(0, num_tokens - window), num_tokens)})

    def step(self, out, seqs: dict[str, Sequence]) -> None:
        """Every scheduled request writes its new tokens' slots (drafts included:
        the step computes them too), then reads its tokens before them: as every
        layer stores the whole batch before any attention reads, a request may
        read a block another request of the same step fills (Scheduler._publish)."""
        for item in out.scheduled:
            tokens = seqs[item.req_id].token_ids[: item.num_computed_tokens] + item.token_ids
            for p in range(item.num_computed_tokens, len(tokens)):
                self.written[item.block_table[p // self.bs]] = tuple(tokens[: p + 1])
        for item in out.scheduled:
            self.holds_prefix(seqs[item.req_id], item.num_computed_tokens)


class FakeStore:
    """A KV store behind a connector (kv/connector.py), as the scheduler sees it:
    a finished request saves its computed whole blocks, at once or later; a new
    request is offered the stored blocks past its cached ones, loaded at once or
    in the background; a background load now and then fails a block, and loads
    fewer tokens. Every save checks that each block holds what it was computed
    from, and every load writes the stored prefix into its blocks."""

    def __init__(self, rng: random.Random, contents: Contents) -> None:
        self.rng, self.contents, self.bs = rng, contents, contents.bs
        self.saved: set[tuple[int, ...]] = set()  # the whole-block prefixes stored
        self.loads: dict[str, tuple[Sequence, list[int], int]] = {}  # in the background
        self.saves: dict[str, list[int]] = {}  # finished, blocks still being read
        self.loaded_tokens = self.saved_blocks = 0
        self.in_background = False  # the last offer's way of loading

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        n = 0
        while num_computed_tokens + n + self.bs < seq.num_tokens and (
            tuple(seq.token_ids[: num_computed_tokens + n + self.bs]) in self.saved
        ):
            n += self.bs
        self.in_background = self.rng.random() < 0.5
        return n, self.in_background

    def after_allocation(self, seq: Sequence, block_ids: list[int], num_external: int) -> None:
        start = seq.num_computed_tokens
        assert len(block_ids) * self.bs == num_external and seq.request_id not in self.loads
        if self.in_background:
            self.loads[seq.request_id] = (seq, block_ids, start)
            return
        for i, block_id in enumerate(block_ids):  # before this step's forward pass
            self.contents.write(seq, block_id, start + (i + 1) * self.bs)
        self.loaded_tokens += num_external

    def finished_loads(self) -> dict[str, int]:
        done = {}
        for req_id in [r for r in self.loads if self.rng.random() < 0.6]:
            seq, block_ids, start = self.loads.pop(req_id)
            good = len(block_ids) if self.rng.random() < 0.8 else self.rng.randrange(len(block_ids))
            for i, block_id in enumerate(block_ids[:good]):
                self.contents.write(seq, block_id, start + (i + 1) * self.bs)
            done[req_id] = good * self.bs
            self.loaded_tokens += good * self.bs
        return done

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        self.contents.holds_prefix(seq, seq.num_computed_tokens // self.bs * self.bs)
        for i in range(seq.num_computed_tokens // self.bs):
            self.saved.add(tuple(seq.token_ids[: (i + 1) * self.bs]))
            self.saved_blocks += 1
        if self.rng.random() < 0.5:
            return False
        self.saves[seq.request_id] = list(block_ids)
        return True

    def finish_some_saves(self, sched: Scheduler) -> None:
        """Saves done: their blocks were not written while the store read them."""
        done = [r for r in self.saves if self.rng.random() < 0.5]
        for req_id in done:
            for block_id in self.saves.pop(req_id):
                assert self.sched_holds(sched, block_id), block_id
        sched.finish_saving(done)

    @staticmethod
    def sched_holds(sched: Scheduler, block_id: int) -> bool:
        return sched.block_manager.blocks[block_id].ref_count > 0


def run_workload(
    w: Workload,
    drafting: Drafting | None = None,
    store_seed: int | None = None,
    kv_window: tuple[int, int] | None = None,
) -> None:
    # With a store, the local prefix cache is off on every other seed, so that what
    # a store holds is loaded rather than found in the pool (a decode worker's case).
    caching = store_seed is None or store_seed % 2 == 0
    manager = BlockManager(w.num_blocks, w.block_size, enable_prefix_caching=caching)
    sched = Scheduler(w.max_num_seqs, w.budget, manager, EngineStats(), kv_window=kv_window)
    contents = Contents(sched)
    store = None
    if store_seed is not None:
        store = FakeStore(random.Random(store_seed), contents)
        sched.kv = ConnectorHook(store, w.block_size)
    prompts = {f: [f * 1000 + i for i in range(12)] for f in range(3)}
    arrivals = sorted((r[3], i) for i, r in enumerate(w.requests))
    seqs: dict[str, Sequence] = {}
    preempted: dict[str, int] = {}
    chunk_ends: dict[str, tuple[int, int]] = {}  # request -> (preemptions, its last chunk's end)
    handed: dict[str, tuple[int, list[int]]] = {}  # request -> (its length then, drafts)
    step = 0
    while arrivals or sched.has_unfinished() or (store is not None and store.saves):
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
        contents.step(out, seqs)
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
        check_blocks_after_update(sched, out)
        if store is not None:
            store.finish_some_saves(sched)
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


@settings(max_examples=120, deadline=None, derandomize=True)
@given(workloads(), st.integers(0, 2**16))
@example(CROWDED, 0)
def test_a_store_loads_and_saves_what_was_computed(w: Workload, seed: int) -> None:
    run_workload(w, Drafting(seed), store_seed=seed + 1)


@settings(max_examples=120, deadline=None, derandomize=True)
@given(workloads(), st.integers(0, 4), st.integers(1, 8))
@example(CROWDED, 2, 2)
def test_a_window_gives_back_only_blocks_no_step_reads(
    w: Workload, sinks: int, window: int
) -> None:
    """Under a kv_window the scheduler gives back the blocks between the sinks and
    the window as requests run; every slot a step reads is still held and holds
    its prefix, and the books balance with the holes."""
    run_workload(w, kv_window=(sinks, window))
