"""The step's seams, each on its own: the scheduler folds a ModelRunnerOutput in
and says what changed, the model runner learns of requests only through the
SchedulerOutput, and the output processor turns plain EngineCoreOutputs into
RequestOutputs, stop strings and logprobs included."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.core.output_processor import OutputProcessor
from engine.kv.block_manager import BlockManager
from engine.outputs import EngineCoreOutput, ModelRunnerOutput
from engine.sched.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats
from tests.engine.conftest import EOS, random_prompts


def scheduler(num_blocks: int = 16, max_model_len: int = 64) -> Scheduler:
    bm = BlockManager(num_blocks, block_size=4)
    return Scheduler(8, 64, bm, EngineStats(), eos_token_ids=[EOS], max_model_len=max_model_len)


def step(sched: Scheduler, tokens: dict[str, int]):
    """Schedule, then fold in a model that samples ``tokens[req_id]``."""
    out = sched.schedule()
    sampled = [item.req_id for item in out.scheduled if item.samples]
    ids = torch.tensor([tokens[r] for r in sampled])
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled, ids))


def test_update_from_output_appends_finishes_and_frees() -> None:
    sched = scheduler(max_model_len=10)
    reqs = {
        "eos": Sequence("eos", [5, 6, 7], SamplingParams()),
        "ignored": Sequence("ignored", [5, 6, 7], SamplingParams(ignore_eos=True)),
        "stop-id": Sequence("stop-id", [5, 6], SamplingParams(stop_token_ids=[9])),
        "short": Sequence("short", [5], SamplingParams(max_tokens=1)),
        "long": Sequence("long", [5] * 9, SamplingParams(max_tokens=50)),
        "runs": Sequence("runs", [5, 6], SamplingParams()),
    }
    for seq in reqs.values():
        sched.add(seq)
    tokens = {"eos": EOS, "ignored": EOS, "stop-id": 9, "short": 3, "long": 3, "runs": 3}
    out, news = step(sched, tokens)
    assert [n.new_token_ids for n in news] == [[tokens[n.request_id]] for n in news]
    reasons = {n.request_id: n.finish_reason for n in news}
    assert reasons == {
        "eos": "stop",
        "ignored": None,
        "stop-id": "stop",
        "short": "length",
        "long": "length",  # max_model_len 10
        "runs": None,
    }
    assert [r.req_id for r in out.new_requests] == list(reqs)
    assert reqs["runs"].token_ids == [5, 6, 3]
    assert set(sched.requests) == {"ignored", "runs"}
    assert sched.block_manager.num_free_blocks == 16 - 2  # one block each for the two left
    # The model runner hears of the four finished requests at the next step, once.
    out, _ = step(sched, tokens)
    assert sorted(out.finished_req_ids) == ["eos", "long", "short", "stop-id"]
    assert out.new_requests == []
    out, _ = step(sched, tokens)
    assert out.finished_req_ids == []


def test_a_request_is_new_to_the_runner_once_even_after_preemption() -> None:
    sched = scheduler(num_blocks=4)
    a, b = Sequence("a", [1] * 8, SamplingParams()), Sequence("b", [2] * 7, SamplingParams())
    sched.add(a)
    sched.add(b)
    out, _ = step(sched, {"a": 3, "b": 3})
    assert [r.req_id for r in out.new_requests] == ["a", "b"]
    out, _ = step(sched, {"a": 3, "b": 3})  # a needs a third block: b is preempted
    assert out.preempted_req_ids == ["b"]
    sched.finish_requests(["a"], "abort")
    out, _ = step(sched, {"b": 3})
    assert [item.req_id for item in out.scheduled] == ["b"]
    assert out.new_requests == [] and out.finished_req_ids == ["a"]


def test_the_output_processor_on_plain_outputs(qwen3) -> None:
    """No engine core at all: outputs typed in by hand, as a front end gets them."""
    tok = LLM(qwen3[0], dtype="float32").tokenizer
    ids = tok.encode("The block manager frees blocks").ids
    proc = OutputProcessor(tok)
    proc.add_request("a", "x", [1, 2], SamplingParams(stop=["frees"], logprobs=1))
    texts = []
    for t in ids:
        logprobs = [([t, 7, 8], [-0.5, -0.1, -0.2])]
        done = proc.process_outputs([EngineCoreOutput("a", [t], logprobs, num_cached_tokens=16)])
        out = done.request_outputs[0]
        texts.append(out.text)
        if out.finished:
            break
    assert out.finish_reason == "stop" and done.reqs_to_abort == ["a"]
    assert out.text == "The block manager "
    assert all(out.text.startswith(t) for t in texts)
    assert out.token_ids == ids[: len(texts)] and out.num_cached_tokens == 16
    assert out.logprobs[0] == {7: -0.1, ids[0]: -0.5}  # the top 1, then the chosen token
    assert out.times is not None
    assert out.times.arrival <= out.times.first_token <= out.times.finished
    assert proc.states == {}  # a finished request is forgotten


def test_request_outputs_report_prefix_cache_hits(qwen3) -> None:
    llm = LLM(qwen3[0], dtype="float32", block_size=4)
    prefix = random_prompts(1, seed=5, low=21, high=22)[0]
    params = SamplingParams(temperature=0, max_tokens=2)
    first = llm.generate([prefix + [7, 8]], params, use_tqdm=False)[0]
    second = llm.generate([prefix + [9]], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 20  # the 5 full blocks of the shared 21 tokens
