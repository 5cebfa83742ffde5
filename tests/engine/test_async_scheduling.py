"""Async (one-step-ahead) scheduling: the engine schedules step N+1 while step
N's forward pass runs, and nothing a caller sees changes. Tokens equal
transformers' greedy ones and the synchronous engine's seeded ones under every
scheduling regime; late finishes waste exactly one token each and lose
nothing; length finishes waste none; the forward really runs while the next
step is scheduled; the structured-output hook makes the engine wait; and a
finished request's id reaches the model runner even when no step follows."""

from __future__ import annotations

import json
import threading

import pytest

import engine.runner.model_runner as model_runner
import engine.sched.async_scheduler as async_scheduler
from engine import LLM, SamplingParams
from tests.engine.conftest import hf_greedy, random_prompts
from tests.engine.test_token_identity import CONFIGS, MAX_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def reference(qwen3) -> list[list[int]]:
    _, model = qwen3
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_greedy_tokens_match_transformers(qwen3, reference, config) -> None:
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True, **CONFIGS[config])
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, reference)):
        assert out.token_ids == ref, f"{config}: prompt {i} differs"
    stats = llm.stats
    if config in ("preemption", "chunked-preempted-shared"):
        assert stats.preemptions > 0, stats
    if config in ("chunked-prefill", "chunked-preempted-shared"):
        assert stats.partial_prefills > 0, stats
    if config in ("prefix-sharing", "chunked-preempted-shared"):
        assert stats.prefix_cache_hit_tokens > 0, stats
    # A request that stopped on EOS had been scheduled once more (these random
    # weights rarely choose EOS); length finishes are known ahead and waste nothing.
    assert stats.discarded_tokens == sum(o.finish_reason == "stop" for o in outputs)
    engine = llm.llm_engine
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)


def run(path, async_scheduling: bool, prompts, params, **kwargs) -> tuple[list, LLM]:
    llm = LLM(path, dtype="float32", async_scheduling=async_scheduling, **kwargs)
    return llm.generate(prompts, params, use_tqdm=False), llm


def test_seeded_sampling_and_logprobs_are_the_same_on_and_off(qwen3) -> None:
    prompts = random_prompts(6, seed=61, low=3, high=20)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=12, logprobs=2)
        for i in range(len(prompts))
    ]
    kwargs = dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=16)  # preempts
    (off, _), (on, llm) = (run(qwen3[0], a, prompts, params, **kwargs) for a in (False, True))
    assert llm.stats.preemptions > 0
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    # The same tokens, with logprobs equal to float rounding: batches are composed
    # differently on and off, and a CPU matmul is not batch-invariant (Chapter 7).
    for a, b in zip(on, off):
        assert [d.keys() for d in a.logprobs] == [d.keys() for d in b.logprobs]
        for da, db in zip(a.logprobs, b.logprobs):
            assert da == pytest.approx(db, abs=1e-4)
    assert [o.finish_reason for o in on] == [o.finish_reason for o in off]


def test_late_finishes_discard_one_token_each_and_free_their_blocks(qwen3) -> None:
    """Stop tokens and stop strings are seen one step late: the step after was
    already scheduled, and its token for the request is discarded."""
    prompts = random_prompts(8, seed=62)
    free_run = [o.token_ids for o in run(qwen3[0], False, prompts, greedy(16))[0]]
    # Each request stops on the token it generates fourth, as a stop token or
    # (for odd ones) as the text of that token, a stop string.
    llm = LLM(qwen3[0], dtype="float32")
    params = []
    for i, tokens in enumerate(free_run):
        if i % 2:
            params.append(greedy(16, stop=[llm.tokenizer.decode([tokens[3]])]))
        else:
            params.append(greedy(16, stop_token_ids=[tokens[3]]))
    (off, _), (on, async_llm) = (run(qwen3[0], a, prompts, params) for a in (False, True))
    assert [(o.token_ids, o.text, o.finish_reason) for o in on] == [
        (o.token_ids, o.text, o.finish_reason) for o in off
    ]
    stopped = sum(o.finish_reason == "stop" for o in on)
    assert stopped >= len(prompts) // 2
    assert async_llm.stats.discarded_tokens == stopped
    engine = async_llm.llm_engine
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert not engine.has_unfinished_requests()


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def test_length_finishes_are_known_ahead_and_waste_nothing(qwen3) -> None:
    prompts = random_prompts(5, seed=63)
    params = [greedy(3 + i, ignore_eos=True) for i in range(len(prompts))]
    (off, sync_llm), (on, async_llm) = (run(qwen3[0], a, prompts, params) for a in (False, True))
    assert [o.token_ids for o in on] == [o.token_ids for o in off]
    assert async_llm.stats.discarded_tokens == 0
    assert async_llm.stats.steps == sync_llm.stats.steps
    assert async_llm.stats.decode_tokens == sync_llm.stats.decode_tokens


def test_the_next_step_is_scheduled_while_the_forward_runs(qwen3) -> None:
    """Each forward pass waits, on the worker thread, until the engine has
    scheduled the next step, placeholders and all. A serial engine, or one whose
    next step needed this step's tokens on the host, would wait forever (here:
    time out); this one finishes, with the same tokens. The last forward has no
    next step to wait for: the engine finds nothing more to schedule. (On a CPU
    the next step's inputs are built on the worker, after this forward pass:
    runner/torch_thread.py.)"""
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True)
    engine = llm.llm_engine
    scheduler, runner = engine.scheduler, engine.executor.model_runner
    calls = {"scheduled": 0, "forward": 0, "ended": False}
    ready = threading.Condition()
    schedule, execute = scheduler.schedule, runner.execute_prepared

    def counted_schedule():
        out = schedule()
        with ready:
            calls["scheduled"] += bool(out.scheduled)
            calls["ended"] |= not out.scheduled
            ready.notify_all()
        return out

    released = []  # for each forward: released by the next step being scheduled?

    def gated_execute(step):
        calls["forward"] += 1
        n = calls["forward"]
        with ready:
            ok = ready.wait_for(lambda: calls["scheduled"] > n or calls["ended"], 30)
            released.append(ok and calls["scheduled"] > n)
        return execute(step)

    scheduler.schedule, runner.execute_prepared = counted_schedule, gated_execute
    prompts = random_prompts(4, seed=64)
    outputs = llm.generate(prompts, greedy(6), use_tqdm=False)
    assert len(released) == llm.stats.steps > 2
    assert all(released[:-1]) and not released[-1], released
    reference, _ = run(qwen3[0], False, prompts, greedy(6))
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]


def stage_spans(llm: LLM) -> dict[tuple[str, int], object]:
    return {(s.stage, s.step): s for s in llm.llm_engine.trace.spans if s.lane != "gpu"}


def test_the_trace_records_every_stage_of_every_step(qwen3, tmp_path) -> None:
    prompts = random_prompts(4, seed=65)
    path = tmp_path / "trace.json"
    for async_scheduling in (False, True):
        llm = LLM(qwen3[0], dtype="float32", async_scheduling=async_scheduling, trace=str(path))
        llm.generate(prompts, greedy(5), use_tqdm=False)
        spans = llm.llm_engine.trace.spans
        steps = llm.stats.steps
        stages = ("schedule", "prepare", "forward", "update", "process")
        assert sorted((s.stage, s.step) for s in spans) == sorted(
            (stage, n) for stage in stages for n in range(1, steps + 1)
        )
        forward_lane = "worker" if async_scheduling else "main"
        # On a CPU the runner's whole share runs on the worker (runner/torch_thread.py).
        runner_stages = ("prepare", "forward")
        assert {s.lane for s in spans if s.stage in runner_stages} == {forward_lane}
        assert {s.lane for s in spans if s.stage not in runner_stages} == {"main"}
        by = stage_spans(llm)
        for n in range(1, steps):
            # Async: step N+1's inputs are built before step N's outputs are folded in.
            ahead = by["prepare", n + 1].end <= by["update", n].start
            assert ahead == async_scheduling, n
        events = json.loads(path.read_text())["traceEvents"]
        assert sum(e["ph"] == "X" for e in events) == len(spans)


def test_a_request_that_needs_its_token_on_the_host_makes_the_engine_wait(
    qwen3, monkeypatch
) -> None:
    """The structured-output hook: while such a request runs, step N is folded
    in before step N+1 is scheduled, and the tokens do not change."""
    monkeypatch.setattr(async_scheduler, "needs_token_on_host", lambda p: p.seed == 1)
    prompts = random_prompts(3, seed=66)
    params = [
        greedy(4, ignore_eos=True),
        greedy(8, seed=1, ignore_eos=True),
        greedy(12, ignore_eos=True),
    ]
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True, trace=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    reference, _ = run(qwen3[0], False, prompts, params)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    by = stage_spans(llm)
    overlapped = [
        n for n in range(1, llm.stats.steps) if by["prepare", n + 1].end <= by["update", n].start
    ]
    # The hooked request runs from step 1 to step 8; once it has finished the
    # engine overlaps again (and step 8 itself was scheduled after step 7 returned).
    assert overlapped and min(overlapped) >= 8, overlapped


def test_an_abort_while_a_step_is_in_flight_loses_nothing_else(qwen3) -> None:
    prompts = random_prompts(3, seed=67)
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True, num_kv_blocks=64)
    engine = llm.llm_engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, greedy(8, ignore_eos=True))
    engine.step()
    engine.step()
    engine.abort_request("r1")  # its next token is being computed
    engine.add_request("r1", prompts[1], greedy(8, ignore_eos=True))  # the id, reused at once
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    reference, _ = run(qwen3[0], False, prompts, greedy(8, ignore_eos=True))
    assert done == {f"r{i}": o.token_ids for i, o in enumerate(reference)}
    assert llm.stats.discarded_tokens == 1
    assert engine.block_manager.num_free_blocks == 64


def test_a_reply_is_published_for_the_next_turn_as_without_overlap(qwen3) -> None:
    """A block is published once its tokens are computed and known: a second turn
    that sends the first's prompt and reply back finds as much of it cached."""
    first = random_prompts(1, seed=69, low=10, high=11)[0]
    found = []
    for async_scheduling in (False, True):
        llm = LLM(qwen3[0], dtype="float32", async_scheduling=async_scheduling, block_size=4)
        reply = llm.generate(first, greedy(14, ignore_eos=True), use_tqdm=False)[0]
        second = first + reply.token_ids + [5, 6, 7]
        found.append(llm.generate(second, greedy(2), use_tqdm=False)[0].num_cached_tokens)
    # Every full block of the first turn's computed tokens: all but the last
    # generated token, which no step fed back.
    computed = len(first) + 14 - 1
    assert found == [computed // 4 * 4] * 2


def test_a_finished_id_waits_for_a_step_to_carry_it_to_the_model_runner(qwen3) -> None:
    """A request finishes late while the other's last token is in flight: the
    next schedule finds nothing to run, and keeps the finished id for the next
    step, so the model runner still forgets the request and frees its slot."""
    prompt = random_prompts(1, seed=70)[0]
    tokens = run(qwen3[0], False, [prompt], greedy(6, ignore_eos=True))[0][0].token_ids
    stop = greedy(20, stop_token_ids=[tokens[2]], ignore_eos=True)
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True, max_num_seqs=2)
    runner = llm.llm_engine.executor.model_runner
    for _ in range(3):  # a slot lost per call would leave none for the third
        outs = llm.generate([prompt, prompt], [stop, greedy(4, ignore_eos=True)], use_tqdm=False)
        assert [len(o.token_ids) for o in outs] == [tokens.index(tokens[2]) + 1, 4]
        assert llm.stats.discarded_tokens > 0  # the first one finished late
        assert len(runner.future.slots) <= 2 and len(runner.requests) <= 2


def test_on_a_cpu_one_thread_does_all_of_the_runners_torch_work(qwen3, monkeypatch) -> None:
    """Every thread that runs torch's parallel operators gets an OpenMP pool of
    its own, and two pools on too few cores slow every forward pass
    (runner/torch_thread.py). So with async scheduling on a CPU the model loads,
    and every call into the runner runs, on the one worker thread, never on the
    engine's own."""
    threads: dict[str, set[int]] = {}

    def record(name, fn):
        def wrapped(*args, **kwargs):
            threads.setdefault(name, set()).add(threading.get_ident())
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(model_runner, "load_model", record("load", model_runner.load_model))
    for name in ("prepare_inputs", "execute_prepared", "kv_cache_config"):
        fn = getattr(model_runner.ModelRunner, name)
        monkeypatch.setattr(model_runner.ModelRunner, name, record(name, fn))
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True)
    llm.generate(random_prompts(3, seed=66), greedy(4), use_tqdm=False)
    assert set(threads) == {"load", "prepare_inputs", "execute_prepared", "kv_cache_config"}
    assert len(set().union(*threads.values())) == 1, threads
    assert threading.get_ident() not in threads["load"]


def test_a_detached_trace_records_nothing_more_and_restores_what_it_wrapped(qwen3) -> None:
    """`deepinfer bench` traces only its timed steps: a StepTrace attached to an
    engine that already has one, then detached, leaves the engine's own trace
    recording and its own spans as they were."""
    from engine.core.trace import StepTrace

    llm = LLM(qwen3[0], dtype="float32", trace=True)
    engine = llm.llm_engine
    runner = engine.executor.model_runner
    extra = StepTrace(engine.scheduler, runner, engine.output_processor, engine.stats)
    llm.generate(random_prompts(2, seed=67), greedy(3), use_tqdm=False)
    recorded, own = len(extra.spans), len(engine.trace.spans)
    assert recorded == own > 0
    extra.detach()
    llm.generate(random_prompts(2, seed=68), greedy(3), use_tqdm=False)
    assert len(extra.spans) == recorded and len(engine.trace.spans) > own
    plain = LLM(qwen3[0], dtype="float32")
    scheduler = plain.llm_engine.scheduler
    trace = StepTrace(
        scheduler,
        plain.llm_engine.executor.model_runner,
        plain.llm_engine.output_processor,
        plain.llm_engine.stats,
    )
    assert "schedule" in vars(scheduler)
    trace.detach()
    assert "schedule" not in vars(scheduler)  # the class's method again


def test_a_shut_down_engine_lets_its_worker_thread_end(qwen3) -> None:
    """The worker's OpenMP pool lives as long as the worker thread, and would slow
    an engine run later on another thread: shutdown lets the thread end. A call
    after it starts a new one."""
    llm = LLM(qwen3[0], dtype="float32", async_scheduling=True)
    runner = llm.llm_engine.executor.model_runner
    llm.generate(random_prompts(2, seed=69), greedy(3), use_tqdm=False)
    worker = runner.worker.call(threading.current_thread)
    llm.llm_engine.executor.shutdown()
    worker.join(timeout=10)
    assert not worker.is_alive()
    assert llm.generate(random_prompts(2, seed=70), greedy(3), use_tqdm=False)
