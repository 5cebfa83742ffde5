"""The GPU path: the Triton backend chosen by default on CUDA, and CUDA graphs
for decode steps. The graph tests need a CUDA GPU (gpu.yml runs them); the
bucket arithmetic is checked everywhere."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.runner.cuda_graph import batch_buckets, bucket_for
from tests.engine.conftest import hf_greedy, random_prompts

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_buckets_cover_every_batch_size() -> None:
    assert batch_buckets(1) == [1]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    buckets = batch_buckets(100)
    for batch in range(1, 101):
        bucket = bucket_for(batch, buckets)
        assert bucket >= batch and bucket - batch < 16
    assert bucket_for(101, buckets) is None


@pytest.mark.gpu
@needs_cuda
def test_cuda_defaults_to_triton_and_graphs(qwen3) -> None:
    llm = LLM(qwen3[0], dtype="float32")
    runner = llm.llm_engine.executor.model_runner
    assert runner.backend.name == "triton"
    assert runner.graphs is not None and runner.graphs.buckets[-1] == 256
    eager = LLM(qwen3[0], dtype="float32", enforce_eager=True).llm_engine
    assert eager.executor.model_runner.graphs is None


@pytest.mark.gpu
@needs_cuda
def test_graph_replay_matches_eager_and_transformers(qwen3) -> None:
    path, model = qwen3
    prompts = random_prompts(11, seed=81)  # 11 decodes pad up to the bucket of 16
    params = SamplingParams(temperature=0, max_tokens=16)
    graphs = LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    eager = LLM(path, dtype="float32", enforce_eager=True).generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in graphs] == [o.token_ids for o in eager]
    reference = [hf_greedy(model, p, 16) for p in prompts]
    assert [o.token_ids for o in graphs] == reference


@pytest.mark.gpu
@needs_cuda
def test_the_sampler_never_waits_for_the_gpu() -> None:
    """Every filter, seeded draws, greedy rows and logprobs, with CUDA set to
    raise on any host synchronisation: the sampled ids stay on the device."""
    from engine.sample.sampler import Sampler, SamplingMetadata, SamplingRow

    params = [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=1, logprobs=3),
        SamplingParams(temperature=0),
    ] * 4
    rows = [SamplingRow(p, seed=i, step=i) for i, p in enumerate(params)]
    md = SamplingMetadata.from_rows(rows, 1000, torch.device("cuda"))
    logits = torch.randn(len(rows), 1000, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.sampled_token_ids.device.type == "cuda"
    assert out.sampled_token_ids[1::2].tolist() == logits[1::2].argmax(-1).tolist()


@pytest.mark.gpu
@needs_cuda
def test_async_scheduling_on_the_gpu_launches_without_waiting(qwen3) -> None:
    """The forward, sampling and the copy of the tokens to pinned memory are
    queued on the stream, with CUDA set to raise on any host synchronisation;
    the tokens equal the synchronous engine's, graphs or not."""
    path, _ = qwen3
    prompts = random_prompts(11, seed=82)
    params = SamplingParams(temperature=0, max_tokens=12)
    reference = LLM(path, dtype="float32").generate(prompts, params, use_tqdm=False)
    for eager in (False, True):
        llm = LLM(path, dtype="float32", async_scheduling=True, enforce_eager=eager)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    engine = llm.llm_engine
    engine.add_request("x", prompts[0], params)
    engine.step()  # the prompt's step is launched; its tokens are still on the way
    scheduler_output = engine.scheduler.schedule()  # a decode, with a placeholder
    torch.cuda.set_sync_debug_mode("error")
    try:
        future = engine.executor.execute_model_async(scheduler_output)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert future.result().sampled_token_ids.device.type == "cpu"
