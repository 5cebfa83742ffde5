"""The compiled decode step (engine/runner/compiled_decode.py): the same greedy tokens as
transformers, one compile for every batch size (two under max-autotune), the cache
written in place, and a clear refusal where it cannot run."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.layers.linear import PackedLinear
from tests.engine.conftest import hf_greedy, random_prompts

MAX_TOKENS = 16
PROMPTS = random_prompts(6, seed=21)


def test_compiled_decode_matches_transformers(checkpoint) -> None:
    arch, path, model = checkpoint
    # Prompts end at different times (some at EOS): the compiled step sees batches
    # of six down to one, which must all run through one graph.
    llm = LLM(path, dtype="float32", compile_decode=True)
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    for i, (out, prompt) in enumerate(zip(outputs, PROMPTS)):
        assert out.token_ids == hf_greedy(model, prompt, MAX_TOKENS), f"{arch}: prompt {i}"
    compiled = llm.llm_engine.executor.model_runner.compiled
    # No compile when a test before this one, in this process, compiled the same graph:
    # Dynamo's cache is the process's, and a model's weights are the graph's inputs.
    assert compiled.compiles <= 1, "a new batch size compiled again"
    assert compiled.steps >= MAX_TOKENS - 2, compiled.steps  # decodes did run compiled
    assert compiled.compile_seconds > 0 or compiled.compiles == 0  # at start-up


def test_max_autotune_matches_transformers(qwen3) -> None:
    """compile_mode="max-autotune": the weights frozen into the graph for Inductor's
    own GEMMs, the same greedy tokens, the model's own weights left unpacked for the
    eager steps, and two graphs, both at start-up: a batch of one, and the rest."""
    path, model = qwen3
    llm = LLM(path, dtype="float32", compile_decode=True, compile_mode="max-autotune")
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False
    )
    for i, (out, prompt) in enumerate(zip(outputs, PROMPTS)):
        assert out.token_ids == hf_greedy(model, prompt, MAX_TOKENS), f"prompt {i}"
    runner = llm.llm_engine.executor.model_runner
    assert runner.compiled.compiles == 2, "batches of six down to one compiled again"
    assert runner.compiled.steps >= MAX_TOKENS - 2, runner.compiled.steps
    assert not any(isinstance(m, PackedLinear) for m in runner.model.modules())
    with pytest.raises(ValueError, match="compile_mode must be one of"):
        LLM(path, dtype="float32", compile_mode="fastest", num_kv_blocks=4)


def test_compiled_step_writes_the_cache_in_place(qwen3) -> None:
    """The cache never enters the graph: the compiled step writes the pool's own
    tensor, which a copy-then-write would leave untouched."""
    path, _ = qwen3
    llm = LLM(path, dtype="float32", compile_decode=True, num_kv_blocks=8, block_size=16)
    runner = llm.llm_engine.executor.model_runner
    k = runner.model.attention_layers()[0].kv_cache.k
    before = k.data_ptr()
    prompt = PROMPTS[0][:5]  # 5 prompt tokens, then 3 decodes: slots 5, 6 and 7 of block 0
    llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert runner.compiled.steps == 3
    assert k.data_ptr() == before
    decoded = k[0, 5:8]  # the keys the compiled steps stored
    assert decoded.abs().sum(dim=(1, 2)).gt(0).all(), "the compiled steps wrote no keys"
    assert torch.equal(k[0, 8:], torch.zeros_like(k[0, 8:]))  # and nothing beyond


def test_compile_decode_refuses_what_it_cannot_do(qwen3) -> None:
    path, _ = qwen3
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(path, dtype="float32", compile_decode=True, enforce_eager=True, num_kv_blocks=4)
    llm = LLM(path, dtype="float32", num_kv_blocks=4)  # the default compiles nothing
    assert llm.llm_engine.executor.model_runner.compiled is None
    # None, what `deepinfer serve` passes: wherever it can run, and quietly not elsewhere.
    llm = LLM(path, dtype="float32", num_kv_blocks=4, compile_decode=None, enforce_eager=True)
    assert llm.llm_engine.executor.model_runner.compiled is None


def test_deepseek_compiles_around_its_opaque_layers(deepseek) -> None:
    """MLA's attention and the MoE layers' routed experts run as opaque operators
    inside one graph: the same tokens as eager, and the experts' token counts
    still kept. (V3.2, whose indexer has no such operator, is refused: test_dsa.py.)"""
    path, _ = deepseek
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    eager = LLM(path, dtype="float32", num_kv_blocks=16)
    compiled = LLM(path, dtype="float32", num_kv_blocks=16, compile_decode=True)
    want = [o.token_ids for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    got = [o.token_ids for o in compiled.generate(PROMPTS, params, use_tqdm=False)]
    assert got == want
    runner = compiled.llm_engine.executor.model_runner
    assert runner.compiled.compiles <= 1 and runner.compiled.steps >= MAX_TOKENS - 2
    counts = expert_tokens(compiled)
    assert counts == expert_tokens(eager) and counts[0] > 0  # compiled steps routed tokens too


def expert_tokens(llm: LLM) -> list[int]:
    """Tokens routed in each MoE layer so far."""
    experts = llm.llm_engine.executor.model_runner.model.experts()
    return [e.token_counts.sum().item() for e in experts]


def test_compile_decode_needs_a_vector_isa(qwen3, monkeypatch) -> None:
    """With no vector ISA (ATEN_CPU_CAPABILITY=default, an old CPU) Inductor writes
    scalar C++ that does not build: refuse True clearly, and run eager for None."""
    import engine.runner.compiled_decode as compiled_decode

    path, _ = qwen3
    monkeypatch.setattr(compiled_decode, "vector_isa", lambda: False)
    with pytest.raises(ValueError, match="no vector ISA"):
        LLM(path, dtype="float32", compile_decode=True, num_kv_blocks=4)
    llm = LLM(path, dtype="float32", num_kv_blocks=4, compile_decode=None)
    assert llm.llm_engine.executor.model_runner.compiled is None
    assert llm.generate(["a b"], SamplingParams(temperature=0, max_tokens=2))[0].token_ids
