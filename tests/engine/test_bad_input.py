"""Bad input gets a ValueError that says what is wrong, and the engine goes on
serving every other request."""

from __future__ import annotations

import json
import re
import shutil

import pytest

from engine import LLM, SamplingParams
from tests.engine.conftest import random_prompts


def test_missing_model_dir(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        LLM(tmp_path / "nope", dtype="float32")


def test_unsupported_architecture_lists_the_supported_ones(qwen3, tmp_path) -> None:
    shutil.copytree(qwen3[0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM"
    ):
        LLM(tmp_path / "m", dtype="float32")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"max_tokens": -3}, "max_tokens must be at least 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
    ],
)
def test_bad_sampling_params(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_fail_alone_and_the_engine_keeps_serving(qwen3) -> None:
    llm = LLM(qwen3[0], dtype="float32", max_model_len=128)
    engine = llm.llm_engine
    good = random_prompts(3, seed=31)
    for i, prompt in enumerate(good[:2]):
        engine.add_request(f"good-{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
    engine.step()  # the good requests are running
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty", [])
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request("empty-text", "")
    with pytest.raises(
        ValueError, match="prompt has 200 tokens, but the maximum model length is 128"
    ):
        engine.add_request("long", [5] * 200)
    with pytest.raises(ValueError, match="token ids must be integers"):
        engine.add_request("oov", [5, 10_000])
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("good-0", [5, 6])
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert sorted(finished) == ["good-0", "good-1"]
    assert all(len(o.token_ids) == 8 or o.finish_reason == "stop" for o in finished.values())
    # generate() checks every prompt before queueing any: a bad one loses nothing.
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([good[2], []], use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert len(llm.generate([good[2]], use_tqdm=False)) == 1


def test_max_model_len_beyond_the_cache_is_refused(qwen3) -> None:
    with pytest.raises(ValueError, match="does not fit in the KV cache"):
        LLM(qwen3[0], dtype="float32", num_kv_blocks=4, block_size=16, max_model_len=100)


def test_llm_keywords_are_engine_config_fields(qwen3) -> None:
    """LLM(...) passes its keywords on to EngineConfig, whose defaults it keeps."""
    config = LLM(qwen3[0], dtype="float32", block_size=8, num_kv_blocks=40).llm_engine.config
    assert (config.block_size, config.num_kv_blocks, config.max_num_seqs) == (8, 40, 256)
    with pytest.raises(TypeError, match="blok_size"):
        LLM(qwen3[0], dtype="float32", blok_size=8)


def test_batch_invariance_with_mla_on_the_cpu_is_refused_up_front(deepseek) -> None:
    """It used to fail at the first decode, inside the backend: the split-KV path
    has no absorbed MLA decode."""
    with pytest.raises(ValueError, match="MLA"):
        LLM(str(deepseek[0]), device="cpu", batch_invariant=True, num_kv_blocks=8)


def test_vllm_prompt_dicts_run_as_the_text_and_token_ids_they_hold(qwen3) -> None:
    """vLLM's TextPrompt and TokensPrompt, alone or in a list mixed with plain
    strings and token lists, give what their text and ids give."""
    llm = LLM(qwen3[0], dtype="float32", max_model_len=128)
    text, ids = "hello world", random_prompts(1, seed=33)[0]
    params = SamplingParams(temperature=0, max_tokens=6)
    plain = [o.token_ids for o in llm.generate([text, ids], params, use_tqdm=False)]
    mixed = llm.generate(
        [{"prompt": text}, {"prompt_token_ids": ids}, ids, text], params, use_tqdm=False
    )
    assert [o.token_ids for o in mixed] == plain + plain[::-1]
    assert mixed[0].prompt == text and mixed[1].prompt_token_ids == ids
    [alone_text] = llm.generate({"prompt": text}, params, use_tqdm=False)
    [alone_ids] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    assert [alone_text.token_ids, alone_ids.token_ids] == plain


@pytest.mark.parametrize(
    "prompt, error, detail",
    [
        ({"prompt": "a", "prompt_token_ids": [5]}, ValueError, "keys"),
        ({"text": "a"}, ValueError, "keys"),
        ({}, ValueError, "keys"),
        ({"prompt": [5, 6]}, TypeError, "'prompt' as list"),
        ({"prompt_token_ids": "5 6"}, TypeError, "'prompt_token_ids' as str"),
        (5, TypeError, "got int"),
    ],
)
def test_a_prompt_of_no_accepted_form_names_the_forms_and_queues_nothing(
    qwen3, prompt, error, detail
) -> None:
    llm = LLM(qwen3[0], dtype="float32", max_model_len=128)
    forms = (
        r"a string, a list of token ids, \{'prompt': str\} or \{'prompt_token_ids': list\[int\]\}"
    )
    with pytest.raises(error, match=f"{forms}, .*{re.escape(detail)}"):
        llm.generate(["fine", prompt], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
