"""The MTP module against its float64 reference (tests/engine/deepseek_reference.py):
the next-next-token logits from the main model's hidden states, through a prompt
chunk (expanded attention) and then one decode step (absorbed) on its own cache."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from engine import LLM
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata
from engine.kv.kv_cache import KVCachePool
from engine.utils import cdiv
from tests.engine import deepseek_reference as ref
from tests.engine.conftest import build_checkpoint, random_prompts


def step_meta(positions: list[int], context: int, decode: bool) -> AttentionMetadata:
    """One sequence whose tokens sit in slots 0, 1, 2, ... (blocks 0, 1, 2, ... of 16)."""
    n = len(positions)
    return AttentionMetadata(
        slot_mapping=torch.tensor(positions),
        block_tables=torch.arange(cdiv(context, 16), dtype=torch.int32)[None],
        context_lens=torch.tensor([context], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=1 if decode else 0,
        context_lens_cpu=[context],
        query_lens_cpu=[n],
    )


def run(runner, meta: AttentionMetadata, fn):
    """fn() as the model runner runs a forward pass: under the step's context, with
    the blocks the step writes zeroed first (the pool zeroes blocks on first use)."""
    runner.kv_cache.touch(int(meta.slot_mapping.max()) // runner.block_size + 1)
    attn_metadata = runner.backend.build_metadata(meta)
    with torch.no_grad(), forward_context(meta, attn_metadata, runner.backend):
        return fn()


def bind_mtp_caches(llm: LLM) -> None:
    """Give the MTP modules blocks, as something that drafts with them would: a
    pool over the main layers and the MTP modules' together."""
    runner = llm.llm_engine.executor.model_runner
    layers = runner.model.attention_layers() + runner.model.mtp_attention_layers()
    runner.kv_cache = KVCachePool(llm.llm_engine.config, layers, runner.device)


def test_mtp_matches_float64_reference(tmp_path) -> None:
    hf = build_checkpoint("deepseek", tmp_path)
    cfg = hf.config
    cfg.rope_theta = cfg.rope_parameters["rope_theta"]
    llm = LLM(tmp_path, dtype="float32", block_size=16, num_kv_blocks=8)
    runner = llm.llm_engine.executor.model_runner
    model = runner.model
    assert len(model.model.mtp) == cfg.num_nextn_predict_layers == 1
    assert all(layer.kv_cache is None for layer in model.mtp_attention_layers())
    bind_mtp_caches(llm)  # no blocks until something drafts: this test does
    ids = torch.tensor(random_prompts(1, seed=41, low=40, high=41)[0])
    t = len(ids)
    pos = torch.arange(t)

    main = step_meta(pos.tolist(), t, decode=False)
    hidden = run(runner, main, lambda: model(ids, pos))
    # Rows 0..t-3 as one prompt chunk, then row t-2 as a decode step.
    chunk = step_meta(pos[: t - 2].tolist(), t - 2, decode=False)
    first = run(runner, chunk, lambda: model.mtp_logits(pos[:-2], hidden[:-2], ids[1:-1]))
    decode = step_meta([t - 2], t - 1, decode=True)
    last = run(runner, decode, lambda: model.mtp_logits(pos[-2:-1], hidden[-2:-1], ids[-1:]))

    expected = ref.mtp_logits(hidden[:-1], ids[1:], load_file(tmp_path / "model.safetensors"), cfg)
    got = torch.cat([first, last])
    err = (got.double() - expected).abs().max().item()
    assert err < 1e-4, f"max |logit difference| {err:.2e}"
    assert expected.std() > 0.1  # logits that say something, not a flat row
