"""A DeepSeek-V3.2 checkpoint that ships its MTP layer, as the published one does
(num_nextn_predict_layers: 1): the layer is a V3.2 decoder layer, with its own
lightning indexer. The engine loads and drafts with it: greedy tokens with its
drafts are the tokens without them, plain and chunked, and each draft the
engine kept through chunked prompts and preemptions is the module's run from
scratch over the whole sequence (issue 49's width checks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.conftest import add_mtp_weights, build_tokenizer, random_prompts
from tests.engine.test_dsa import dsa_config
from tests.engine.test_spec_mtp import checked_from_scratch, kept_drafts, mtp

PROMPTS = random_prompts(4, seed=31, low=5, high=60)
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def v32_mtp(tmp_path_factory) -> Path:
    import transformers
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32DecoderLayer

    path = tmp_path_factory.mktemp("deepseek-v32-mtp")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(dsa_config(num_nextn_predict_layers=1)).eval()
    model.save_pretrained(path)
    model.config.mlp_layer_types.append("sparse")  # the MTP layer's, past the main ones
    add_mtp_weights(model, path, DeepseekV32DecoderLayer)
    build_tokenizer(path)
    return path


@pytest.mark.parametrize("chunk", [None, 16], ids=["plain", "chunked"])
def test_v32_mtp_drafts_leave_greedy_tokens_unchanged(v32_mtp, chunk: int | None) -> None:
    options = {"max_num_batched_tokens": chunk} if chunk else {}
    plain = LLM(v32_mtp, dtype="float32", **options)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    llm = LLM(v32_mtp, dtype="float32", speculative_config=mtp(2), **options)
    got = [o.token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert got == want
    assert llm.llm_engine.stats.spec_decode.num_drafts > 0
    assert len(llm.llm_engine.executor.model_runner.model.mtp_attention_layers()) == 1


def test_each_kept_v32_draft_is_the_module_s_over_the_whole_sequence(v32_mtp) -> None:
    llm = LLM(
        v32_mtp,
        dtype="float32",
        max_num_batched_tokens=20,
        num_kv_blocks=30,
        block_size=4,
        speculative_config=mtp(2),
    )
    kept = kept_drafts(llm, random_prompts(5, seed=32, low=30, high=60), max_tokens=16)
    assert llm.stats.preemptions > 0 and llm.stats.partial_prefills > 0
    checked = checked_from_scratch(v32_mtp, kept, 2)
    assert len(kept) >= 20 and checked > 0.9 * len(kept)
