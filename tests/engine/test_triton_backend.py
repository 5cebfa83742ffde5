"""The whole engine on the Triton backend, under Triton's interpreter on CPU:
the same greedy tokens as the torch reference backend and as transformers, through
plain prefill, chunked prefill, prefix-cache hits and decode, and decodes whose
context is cut into several of the decode kernel's splits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.triton

SCRIPT = textwrap.dedent(
    """
    import sys
    from engine import LLM, SamplingParams
    from tests.engine.conftest import random_prompts

    path = sys.argv[1]
    prefix = random_prompts(1, seed=71, low=40, high=41)[0]
    prompts = [prefix + p for p in random_prompts(3, seed=72, low=2, high=20)]
    prompts += random_prompts(3, seed=73)
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, dtype="float32", attention_backend=backend, max_num_batched_tokens=48, max_num_seqs=4)
        outputs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.stats
        assert stats.partial_prefills > 0 and stats.prefix_cache_hit_tokens > 0, stats
    assert outputs["torch"] == outputs["triton"], outputs
    from transformers import AutoModelForCausalLM
    from tests.engine.conftest import hf_greedy

    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    assert outputs["triton"] == [hf_greedy(hf, p, 8) for p in prompts]
    print("identical", len(prompts))
    """
)

# Contexts past the decode kernel's split size, so decode merges several splits,
# beside a short one that needs one; checked against transformers too.
LONG_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from transformers import AutoModelForCausalLM
    from engine import LLM, SamplingParams
    from engine.kernels.decode_attention import KV_SPLIT_SIZE
    from tests.engine.conftest import hf_greedy, random_prompts

    path = sys.argv[1]
    prompts = random_prompts(1, seed=74, low=KV_SPLIT_SIZE - 6, high=KV_SPLIT_SIZE - 5)
    prompts += random_prompts(1, seed=75, low=KV_SPLIT_SIZE + 40, high=KV_SPLIT_SIZE + 41)
    prompts += random_prompts(1, seed=76, low=5, high=6)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(path, dtype="float32", attention_backend="triton")
    triton_tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    expected = [hf_greedy(model, p, 12) for p in prompts]
    assert triton_tokens == expected, (triton_tokens, expected)
    print("identical past", KV_SPLIT_SIZE)
    """
)


def run(script: str, *args: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"  # must be set before triton is imported
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, env=env, timeout=600
    )


# deepseek: the MLA decode kernel, with low-rank queries, interleaved RoPE and grouped
# routing; deepseek_yarn: with direct queries, YaRN (its softmax scale and cos/sin) and
# one expert group.
@pytest.mark.parametrize("model", ["qwen3", "deepseek", "deepseek_yarn"])
def test_triton_backend_matches_torch_backend(model, request) -> None:
    proc = run(SCRIPT, str(request.getfixturevalue(model)[0]), interpret=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "identical 6"


def test_triton_on_cpu_without_the_interpreter_is_a_clear_error(qwen3) -> None:
    script = "import sys; from engine import LLM; LLM(sys.argv[1], dtype='float32', attention_backend='triton')"
    proc = run(script, str(qwen3[0]), interpret=False)
    assert proc.returncode != 0
    assert "set TRITON_INTERPRET=1" in proc.stderr
    assert 'attention_backend="torch"' in proc.stderr


def test_triton_decode_past_one_split_matches_transformers(qwen3) -> None:
    proc = run(LONG_SCRIPT, str(qwen3[0]), interpret=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "identical past 256"


# A quantized cache: the Triton kernels read the codes and scales the torch path
# reads, so greedy tokens agree through chunked prefill, prefix hits and decode.
QUANT_SCRIPT = textwrap.dedent(
    """
    import sys
    from engine import LLM, SamplingParams
    from tests.engine.conftest import random_prompts

    path = sys.argv[1]
    prefix = random_prompts(1, seed=81, low=40, high=41)[0]
    prompts = [prefix + p for p in random_prompts(2, seed=82, low=2, high=20)]
    prompts += random_prompts(2, seed=83)
    params = SamplingParams(temperature=0, max_tokens=8)
    for fmt in ("fp8_e4m3", "int8"):
        outputs = {}
        for backend in ("torch", "triton"):
            llm = LLM(path, dtype="float32", attention_backend=backend, kv_cache_dtype=fmt,
                      max_num_batched_tokens=48, max_num_seqs=4)
            outputs[backend] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
            assert llm.stats.partial_prefills > 0 and llm.stats.prefix_cache_hit_tokens > 0
        assert outputs["torch"] == outputs["triton"], (fmt, outputs)
    print("identical", len(prompts))
    """
)


def test_triton_backend_on_a_quantized_cache_matches_torch_backend(qwen3) -> None:
    proc = run(QUANT_SCRIPT, str(qwen3[0]), interpret=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "identical 4"
