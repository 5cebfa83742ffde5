"""The first generated token's logits equal transformers' to within 1e-4."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts


def test_first_token_logits_match_transformers(checkpoint) -> None:
    arch, path, model = checkpoint
    llm = LLM(path, dtype="float32")
    engine = llm.llm_engine
    prompts = random_prompts(4, seed=11)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=1))
    runner = engine.executor.model_runner
    step = runner.prepare_inputs(engine.scheduler.schedule())
    batch, logits = step.batch, runner.forward(step)
    assert batch.req_ids == ["0", "1", "2", "3"]
    for prompt, row in zip(prompts, logits):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0, -1]
        err = (row - expected).abs().max().item()
        assert err < 1e-4, f"{arch}: max |logit difference| {err:.2e}"
