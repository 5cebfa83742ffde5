"""The scheduler's seam to an outside source of cached blocks (kv/connector.py):
a connector's tokens count as computed once loaded, a load in the background
keeps its request in WAITING_FOR_KV and out of every step until it is done, and
a connector that saves a finished request's blocks keeps them held until then."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv.block_manager import BlockManager
from engine.kv.connector import KVConnector, NoConnector
from engine.outputs import EngineCoreEventType, EngineCoreOutput, FinishReason, ModelRunnerOutput
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.stats import EngineStats
from tests.engine.test_scheduler_property import Workload, answer, check_chunks, workloads

BLOCK = 4


class DictConnector:
    """An outside store backed by a dict: request id -> how many of its leading
    tokens the store holds. It records what the scheduler tells it."""

    def __init__(self, held: dict[str, int], load_async: bool = False, save: bool = False) -> None:
        self.held = held
        self.load_async = load_async
        self.save = save  # keep finished requests' blocks until saved?
        self.asked: dict[str, int] = {}  # request -> num_computed_tokens it was asked past
        self.allocated: dict[str, tuple[list[int], int]] = {}
        self.finished: dict[str, list[int]] = {}

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        self.asked[seq.request_id] = num_computed_tokens
        n = max(self.held.get(seq.request_id, 0) - num_computed_tokens, 0)
        return n, self.load_async

    def after_allocation(
        self, seq: Sequence, block_ids: list[int], num_external_tokens: int
    ) -> None:
        self.allocated[seq.request_id] = (list(block_ids), num_external_tokens)

    def finished_loads(self) -> dict[str, int]:
        return {}  # the tests report loads themselves (Scheduler.kv_loaded)

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        self.finished[seq.request_id] = list(block_ids)
        return self.save


def make(
    connector: KVConnector | None, num_blocks: int = 32, budget: int = 64, max_num_seqs: int = 8
) -> Scheduler:
    bm = BlockManager(num_blocks, BLOCK)
    return Scheduler(max_num_seqs, budget, bm, EngineStats(), connector=connector)


def run(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> list[EngineCoreOutput]:
    """Fold in a step's output, from a model that always samples ``token``."""
    sampled = [item.req_id for item in out.scheduled if item.samples]
    tokens = torch.full((len(sampled),), token)
    return sched.update_from_output(out, ModelRunnerOutput(sampled, tokens))


def prompt(n: int, base: int = 0) -> list[int]:
    return [base + i for i in range(n)]


def test_a_synchronous_load_skips_the_compute_of_its_tokens() -> None:
    conn = DictConnector({"a": 12})
    sched = make(conn)
    seq = Sequence("a", prompt(18), SamplingParams(max_tokens=2))
    sched.add(seq)
    out = sched.schedule()
    [item] = out.scheduled
    assert (item.num_computed_tokens, item.token_ids) == (12, prompt(18)[12:])
    assert conn.allocated["a"] == (seq.block_table[:3], 12)
    assert sched.stats.prefill_tokens == 6 and sched.stats.prefix_cache_hit_tokens == 0
    assert seq.num_cached_prompt_tokens == 12
    assert [n.req_id for n in out.new_requests] == ["a"]
    run(sched, out)
    assert seq.num_computed_tokens == 18 and seq.output_token_ids == [7]


def test_the_connector_is_asked_past_the_local_prefix_cache() -> None:
    """The first request computes two blocks; the second finds them locally,
    and the connector's third block is the only one it loads."""
    conn = DictConnector({"b": 12})
    sched = make(conn)
    sched.add(Sequence("a", prompt(9), SamplingParams(max_tokens=1)))
    run(sched, sched.schedule())
    b = Sequence("b", prompt(18), SamplingParams(max_tokens=1))
    sched.add(b)
    [item] = sched.schedule().scheduled
    assert conn.asked["b"] == 8
    assert conn.allocated["b"] == ([b.block_table[2]], 4)
    assert item.num_computed_tokens == 12
    assert sched.stats.prefix_cache_hit_tokens == 8


def test_an_asynchronous_load_waits_and_then_runs() -> None:
    conn = DictConnector({"a": 12}, load_async=True)
    sched = make(conn)
    a = Sequence("a", prompt(18), SamplingParams(max_tokens=2))
    b = Sequence("b", prompt(5, base=100), SamplingParams(max_tokens=2))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a holds blocks for its loaded tokens only, waits, and does not block b.
    assert [item.req_id for item in out.scheduled] == ["b"]
    assert a.status is SequenceStatus.WAITING_FOR_KV and a not in sched.running
    assert a.num_computed_tokens == 0 and len(a.block_table) == 3
    assert conn.allocated["a"] == (a.block_table, 12)
    assert len(sched.block_manager.cached_blocks) == 1  # b's block: none of a's yet
    run(sched, out)
    out = sched.schedule()
    assert [item.req_id for item in out.scheduled] == ["b"]  # a is still loading
    run(sched, out)
    sched.kv_loaded(["a"])
    assert a.status is SequenceStatus.RUNNING and a.num_computed_tokens == 12
    assert len(sched.block_manager.cached_blocks) == 4  # a's loaded blocks are offered
    out = sched.schedule()
    item = next(item for item in out.scheduled if item.req_id == "a")
    assert (item.num_computed_tokens, item.token_ids) == (12, prompt(18)[12:])
    [core] = [core for core in run(sched, out) if core.request_id == "a"]
    assert a.output_token_ids == [7] and core.num_cached_tokens == 12
    # a was queued in step 1, and scheduled in step 3 with 12 tokens it did not compute.
    E = EngineCoreEventType
    events = [(e.type, e.step, e.num_cached_tokens) for e in core.events]
    assert events == [(E.QUEUED, 1, 0), (E.SCHEDULED, 3, 12)]


def test_a_step_with_only_loads_in_flight_is_empty_and_says_nothing() -> None:
    """Nothing to run: the output is empty, no step is counted, the requests are
    still unfinished, and what the runner must hear (a new request, an abort)
    comes with the next output that runs a step."""
    conn = DictConnector({"a": 8}, load_async=True)
    sched = make(conn)
    sched.add(Sequence("a", prompt(10), SamplingParams(max_tokens=1)))
    sched.add(Sequence("x", prompt(3, base=50), SamplingParams()))
    sched.finish_requests(["x"], FinishReason.ABORT)
    out = sched.schedule()
    assert out == SchedulerOutput()
    assert sched.stats.steps == 0 and sched.has_unfinished()
    assert sched.schedule() == SchedulerOutput()
    sched.kv_loaded(["a"])
    out = sched.schedule()
    assert [(item.req_id, item.num_new_tokens) for item in out.scheduled] == [("a", 2)]
    assert [n.req_id for n in out.new_requests] == ["a"]
    assert out.finished_req_ids == ["x"]
    assert sched.stats.steps == 1
    run(sched, out)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 32


def test_a_load_in_flight_takes_a_seat() -> None:
    """max_num_seqs counts a request waiting for its KV: it will run once loaded."""
    conn = DictConnector({"a": 4}, load_async=True)
    sched = make(conn, max_num_seqs=1)
    sched.add(Sequence("a", prompt(6), SamplingParams()))
    sched.add(Sequence("b", prompt(6, base=100), SamplingParams()))
    assert sched.schedule().scheduled == []
    assert [s.request_id for s in sched.waiting] == ["b"]


def test_request_finished_true_keeps_the_blocks_until_they_are_saved() -> None:
    conn = DictConnector({}, save=True)
    sched = make(conn, num_blocks=8)
    a = Sequence("a", prompt(9), SamplingParams(max_tokens=1))
    sched.add(a)
    run(sched, sched.schedule())
    assert a.is_finished and not sched.has_unfinished()
    held = conn.finished["a"]
    assert len(held) == 3 and "a" in sched.kv.saving
    bm = sched.block_manager
    assert bm.num_free_blocks == 5 and all(bm.blocks[b].ref_count == 1 for b in held)
    with pytest.raises(ValueError, match="still holds blocks"):
        sched.add(Sequence("a", prompt(3), SamplingParams()))
    sched.finish_saving(["a"])
    assert bm.num_free_blocks == 8 and not sched.kv.saving
    assert all(bm.blocks[b].ref_count == 0 for b in held)


def test_a_request_aborted_while_loading_frees_its_blocks_once_loaded() -> None:
    """The loader may still be writing them: they stay held until kv_loaded."""
    conn = DictConnector({"a": 8}, load_async=True)
    sched = make(conn, num_blocks=8)
    a = Sequence("a", prompt(10), SamplingParams())
    sched.add(a)
    sched.schedule()
    sched.finish_requests(["a"], FinishReason.ABORT)
    assert a.is_finished and conn.finished["a"] == a.block_table
    assert sched.block_manager.num_free_blocks == 6
    assert sched.has_unfinished() and list(sched.kv.loading) == ["a"]  # the load is in flight
    sched.kv_loaded(["a"])
    assert sched.block_manager.num_free_blocks == 8 and not sched.has_unfinished()
    assert sched.running == [] and list(sched.waiting) == []
    # The runner never heard of a (its only step was empty): it hears of the end only.
    sched.add(Sequence("b", prompt(3, base=100), SamplingParams()))
    out = sched.schedule()
    assert [n.req_id for n in out.new_requests] == ["b"] and out.finished_req_ids == ["a"]


def test_one_step_ahead_scheduling_runs_a_loaded_request_too() -> None:
    """AsyncScheduler: nothing is in flight while a loads; once loaded, its steps
    overlap as any request's do, and it outputs the tokens it would have."""
    from engine.sched.async_scheduler import AsyncScheduler

    conn = DictConnector({"a": 8}, load_async=True)
    sched = AsyncScheduler(8, 64, BlockManager(32, BLOCK), EngineStats(), connector=conn)
    a = Sequence("a", prompt(10), SamplingParams(max_tokens=3))
    sched.add(a)
    assert sched.schedule() == SchedulerOutput() and not sched.in_flight
    sched.kv_loaded(["a"])
    first, second = sched.schedule(), sched.schedule()
    assert [(i.num_computed_tokens, i.num_new_tokens) for i in first.scheduled] == [(8, 2)]
    assert [(i.num_computed_tokens, i.num_new_tokens) for i in second.scheduled] == [(10, 1)]
    run(sched, first, token=21)
    run(sched, second, token=22)
    run(sched, sched.schedule(), token=23)
    assert a.is_finished and a.output_token_ids == [21, 22, 23]
    assert sched.block_manager.num_free_blocks == 32


@pytest.mark.parametrize("offer", [3, 12])  # not a whole block; reaches the last token
def test_a_connector_may_offer_whole_blocks_before_the_last_token_only(offer: int) -> None:
    sched = make(DictConnector({"a": offer}))
    sched.add(Sequence("a", prompt(12), SamplingParams()))
    with pytest.raises(ValueError, match="whole blocks before the last token"):
        sched.schedule()


def test_no_connector_holds_nothing() -> None:
    conn = NoConnector()
    seq = Sequence("a", prompt(12), SamplingParams())
    assert conn.num_external_tokens(seq, 0) == (0, False)
    assert conn.request_finished(seq, [1, 2]) is False
    sched = make(None)
    assert isinstance(sched.kv.connector, NoConnector)
    sched.add(seq)
    [item] = sched.schedule().scheduled
    assert item.num_computed_tokens == 0 and item.num_new_tokens == 12


class RandomStore(DictConnector):
    """A store that holds each request's whole blocks up to some length, loads
    some in the background and saves some requests when they finish."""

    def __init__(self, held: dict[str, int], slow: set[str], saved: set[str]) -> None:
        super().__init__(held)
        self.slow, self.saved = slow, saved

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        n, _ = super().num_external_tokens(seq, num_computed_tokens)
        n = min(n, (seq.num_tokens - 1) // BLOCK * BLOCK - num_computed_tokens)
        return max(n, 0), seq.request_id in self.slow

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        super().request_finished(seq, block_ids)
        return seq.request_id in self.saved


@settings(max_examples=200, deadline=None, derandomize=True)
@given(workloads(), st.data())
def test_random_workloads_with_a_store_end_as_they_would_alone(
    w: Workload, data: st.DataObject
) -> None:
    """test_scheduler_property's workloads (block size 4 here), with a store that
    holds some requests' prefixes, loads some late and saves some: outputs are
    unchanged, loads and saves hold blocks until reported, and every block comes back."""
    n = len(w.requests)
    held = {f"r{i}": data.draw(st.integers(0, 3)) * BLOCK for i in range(n)}
    slow = {f"r{i}" for i in range(n) if data.draw(st.booleans())}
    saved = {f"r{i}" for i in range(n) if data.draw(st.booleans())}
    store = RandomStore(held, slow, saved)
    bm = BlockManager(w.num_blocks * w.block_size // BLOCK + 1, BLOCK)
    sched = Scheduler(w.max_num_seqs, w.budget, bm, EngineStats(), connector=store)
    prompts = {f: [f * 1000 + i for i in range(12)] for f in range(3)}
    arrivals = sorted((r[3], i) for i, r in enumerate(w.requests))
    seqs: dict[str, Sequence] = {}
    chunk_ends: dict[str, tuple[int, int]] = {}
    reported: set[str] = set()  # saves the store has reported done
    step = 0
    while arrivals or sched.has_unfinished() or sched.kv.saving:
        while arrivals and arrivals[0][0] <= step:
            i = arrivals.pop(0)[1]
            family, length, max_tokens, _, _ = w.requests[i]
            params = SamplingParams(max_tokens=max_tokens)
            seqs[f"r{i}"] = seq = Sequence(f"r{i}", prompts[family][:length], params)
            sched.add(seq)
        sched.finish_requests([f"r{i}" for i, r in enumerate(w.requests) if r[4] == step], "abort")
        sched.kv_loaded([r for r in list(sched.kv.loading) if data.draw(st.booleans())])
        done = [r for r in list(sched.kv.saving) if data.draw(st.booleans())]
        sched.finish_saving(done)
        reported.update(done)
        out = sched.schedule()
        assert not {item.req_id for item in out.scheduled} & set(sched.kv.loading)
        check_chunks(out.scheduled, seqs, chunk_ends)
        sampled = [item.req_id for item in out.scheduled if item.samples]
        tokens = [answer(r, seqs[r].num_output_tokens) for r in sampled]
        sched.update_from_output(out, ModelRunnerOutput(sampled, torch.tensor(tokens)))
        holders = [s for s in seqs.values() if s.block_table]
        held = {b for s in holders for b in s.block_table}  # shared blocks once
        assert not held & set(bm.free_blocks) and len(held) + bm.num_free_blocks == len(bm.blocks)
        for s in holders:  # a finished request holds blocks only for the store
            assert (
                not s.is_finished
                or s.request_id in sched.kv.loading
                or s.request_id in sched.kv.saving
            )
        for rid, blocks in store.finished.items():  # a save not yet reported keeps its blocks
            assert rid not in saved or rid in reported or seqs[rid].block_table == blocks, rid
        step += 1
        assert step < 500, "the workload did not drain"
    for rid, seq in seqs.items():
        want = [answer(rid, k) for k in range(seq.params.max_tokens)]
        assert seq.is_finished
        if seq.finish_reason == "abort":
            assert seq.output_token_ids == want[: seq.num_output_tokens], rid
        else:
            assert seq.output_token_ids == want, rid
    assert bm.num_free_blocks == len(bm.blocks) and not sched.kv.loading


class PoolConnector:
    """A store between two real engines: it holds engine A's blocks of one
    prompt (read with read_blocks) and writes them into engine B's pool
    (write_blocks) as soon as B's scheduler allocates blocks for them."""

    def __init__(self, prompt: list[int], data, num_tokens: int, pool, load_async: bool) -> None:
        self.prompt, self.data, self.num_tokens, self.pool = prompt, data, num_tokens, pool
        self.load_async = load_async
        self.loaded: list[str] = []

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        if seq.prompt_token_ids != self.prompt or num_computed_tokens:
            return 0, False
        return self.num_tokens, self.load_async

    def after_allocation(self, seq: Sequence, block_ids: list[int], num_external: int) -> None:
        self.pool.write_blocks(block_ids, self.data)  # the worker side's copy
        self.loaded.append(seq.request_id)

    def finished_loads(self) -> dict[str, int]:
        return {}  # the test reports the load itself (Scheduler.kv_loaded)

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        return False


@pytest.mark.parametrize("load_async", [False, True], ids=["sync", "async"])
def test_blocks_moved_between_engines_give_the_same_tokens(qwen3, load_async) -> None:
    """Prefill on engine A, its blocks carried to engine B through a connector:
    B computes only the prompt's tail and decodes A's greedy tokens exactly.
    In the background case B's first step has nothing to run, and says so."""
    from engine import LLM

    kwargs = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=64, enable_prefix_caching=True)
    ids = prompt(23, base=11)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    a = LLM(str(qwen3[0]), **kwargs)
    expected = a.generate([ids], params, use_tqdm=False)[0].token_ids
    engine_a = a.llm_engine
    blocks = engine_a.block_manager.match_prefix(ids)  # A's cached prompt blocks
    assert len(blocks) == (len(ids) - 1) // BLOCK == 5
    data = engine_a.executor.model_runner.kv_cache.read_blocks(blocks)

    b = LLM(str(qwen3[0]), **kwargs)
    engine_b = b.llm_engine
    pool_b = engine_b.executor.model_runner.kv_cache
    conn = PoolConnector(ids, data, len(blocks) * BLOCK, pool_b, load_async)
    engine_b.scheduler.kv.connector = conn
    engine_b.add_request("r", ids, params)
    if load_async:
        assert engine_b.step() == []  # only a load in flight: nothing to run, no error
        assert engine_b.scheduler.requests["r"].status is SequenceStatus.WAITING_FOR_KV
        engine_b.scheduler.kv_loaded(["r"])
    before = engine_b.stats.prefill_tokens
    outputs = []
    while engine_b.has_unfinished_requests():
        outputs += engine_b.step()
    assert conn.loaded == ["r"]
    assert engine_b.stats.prefill_tokens - before == len(ids) - len(blocks) * BLOCK
    assert outputs[-1].finished and outputs[-1].token_ids == expected


def test_without_a_load_in_flight_an_empty_step_is_still_an_error(qwen3) -> None:
    from engine import LLM

    llm = LLM(str(qwen3[0]), dtype="float32", block_size=BLOCK, num_kv_blocks=64)
    with pytest.raises(RuntimeError, match="none could be scheduled"):
        llm.llm_engine._idle()
