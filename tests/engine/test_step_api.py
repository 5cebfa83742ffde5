"""The server-facing API: add_request, step, has_unfinished_requests and
abort_request, with outputs that grow one token per step."""

from __future__ import annotations

from engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts


def test_step_outputs_are_incremental_and_finish(qwen3) -> None:
    engine = LLM(qwen3[0], dtype="float32").llm_engine
    prompts = random_prompts(3, seed=51)
    for i, p in enumerate(prompts):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True)
        )
    seen: dict[str, list[int]] = {}
    finished = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            previous = seen.get(out.request_id, [])
            assert out.token_ids[: len(previous)] == previous
            assert len(out.token_ids) == len(previous) + 1
            seen[out.request_id] = out.token_ids
            if out.finished:
                finished.append(out.request_id)
                assert out.finish_reason == "length"
    assert finished == ["r0", "r1", "r2"]
    assert [len(seen[f"r{i}"]) for i in range(3)] == [4, 5, 6]


def test_abort_frees_blocks_and_others_continue(qwen3) -> None:
    llm = LLM(qwen3[0], dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    engine = llm.llm_engine
    for i, p in enumerate(random_prompts(3, seed=52)):
        engine.add_request(
            f"r{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        )
    engine.step()
    engine.step()
    before = engine.block_manager.num_free_blocks
    engine.abort_request("r1")
    assert engine.block_manager.num_free_blocks > before
    engine.abort_request("no-such-request")  # unknown ids are ignored
    done = []
    while engine.has_unfinished_requests():
        done += [o.request_id for o in engine.step() if o.finished]
    assert sorted(done) == ["r0", "r2"]
    assert engine.block_manager.num_free_blocks == 64


def test_a_dropped_engine_is_freed_at_once(qwen3) -> None:
    """The engine freezes its start-up heap out of the garbage collector's scans,
    so it must hold no reference cycles: dropping it frees it, model and cache."""
    import weakref

    llm = LLM(qwen3[0], dtype="float32")
    llm.generate(random_prompts(2, seed=53), SamplingParams(max_tokens=3), use_tqdm=False)
    runner = llm.llm_engine.executor.model_runner
    refs = [weakref.ref(o) for o in (llm.llm_engine, runner.model, runner.kv_cache)]
    del llm, runner
    assert [r() for r in refs] == [None, None, None]
