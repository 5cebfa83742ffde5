"""DeepSeek-V3 in the engine, beyond token identity (test_token_identity.py runs the
tiny DeepSeek configs through every scheduling regime): absorbed decode against
expanded attention, the experts' token counts, and clear errors for variants the
engine does not implement."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.utils import cdiv
from tests.engine.conftest import random_prompts
from tests.engine.test_mtp import run


def one_sequence(n: int, context: int, decode: bool) -> AttentionMetadata:
    """The last n of ``context`` tokens of one sequence, in slots 0.. (blocks of 16)."""
    return AttentionMetadata(
        slot_mapping=torch.arange(context - n, context),
        block_tables=torch.arange(cdiv(context, 16), dtype=torch.int32)[None],
        context_lens=torch.tensor([context], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=int(decode),
        context_lens_cpu=[context],
        query_lens_cpu=[n],
    )


def test_absorbed_decode_equals_expanded_attention(deepseek) -> None:
    """The same query over the same cached latents, once as a decode (absorbed: W_UK
    in the query, W_UV on the output, the latents read as one KV head) and once as a
    one-token prompt chunk (expanded into per-head keys and values)."""
    llm = LLM(deepseek[0], dtype="float32", block_size=16, num_kv_blocks=8)
    runner = llm.llm_engine.executor.model_runner
    attn = runner.model.model.layers[1].self_attn
    torch.manual_seed(0)
    context = 37
    x = torch.randn(context, attn.o_proj.out_features)
    positions = torch.arange(context)
    outputs = []
    for decode in (True, False):
        fill = one_sequence(context - 1, context - 1, decode=False)
        run(runner, fill, lambda: attn(positions[:-1], x[:-1]))
        last = one_sequence(1, context, decode=decode)
        outputs.append(run(runner, last, lambda: attn(positions[-1:], x[-1:])))
    absorbed, expanded = outputs
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-6)
    assert expanded.abs().max() > 0.01


def test_expert_token_counts_reach_the_stats(deepseek) -> None:
    llm = LLM(deepseek[0], dtype="float32")
    prompts = random_prompts(3, seed=21)
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    counts = llm.stats.expert_tokens  # [MoE layer, expert]: layer 1, then the MTP module's
    cfg = json.loads((deepseek[0] / "config.json").read_text())
    assert counts.shape == (2, cfg["n_routed_experts"])
    # Every token the model ran (prompts, and each output but the last) chose top_k experts.
    tokens = sum(len(p) + len(o.token_ids) - 1 for p, o in zip(prompts, outputs))
    assert counts[0].sum() == tokens * cfg["num_experts_per_tok"]
    assert counts[1].sum() == 0  # generation does not run the MTP module
    assert (counts[0] > 0).sum() > 1  # spread over experts, not all on one


@pytest.mark.parametrize(
    ("field", "value"),
    [("scoring_func", "softmax"), ("topk_method", "greedy"), ("moe_layer_freq", 2)],
)
def test_unsupported_variant_is_named_at_load(deepseek, tmp_path, field, value) -> None:
    shutil.copytree(deepseek[0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config[field] = value
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"unsupported {field} {value!r} in config.json"):
        LLM(tmp_path / "m", dtype="float32")


def test_mtp_copy_of_the_embedding_must_equal_the_main_one(deepseek, tmp_path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(deepseek[0], folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.2.embed_tokens.weight"][3] += 1
    save_file(weights, folder / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.2\.embed_tokens\.weight differs"):
        LLM(folder, dtype="float32")


def test_bench_reports_the_cache_pool_bytes_per_token(deepseek, qwen3) -> None:
    """MLA's pool keeps kv_lora_rank + rope numbers per token and layer; a dense MHA
    of the same width keeps a key and a value of the full width; qwen3's pool, a
    key and a value per KV head."""
    from engine.tools.bench import kv_cache_lines

    cfg = json.loads((deepseek[0] / "config.json").read_text())
    lines = kv_cache_lines(LLM(deepseek[0], dtype="float32", num_kv_blocks=4), [str(qwen3[0])])
    latent = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4  # float32 on the CPU
    dense = 2 * cfg["hidden_size"] * 4
    qwen = json.loads((qwen3[0] / "config.json").read_text())
    gqa = 2 * qwen["num_key_value_heads"] * qwen["head_dim"] * 4
    assert lines[1].split()[-2:] == [str(latent), "bytes"], lines
    assert f"{dense} bytes  {dense / latent:5.2f}x" in lines[2], lines
    assert f"{gqa} bytes  {gqa / latent:5.2f}x" in lines[3], lines


class RecordingBackend:
    """The runner's backend, with a log of the MLA cache calls that reach it."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if name in ("store_latent", "gather_latents", "mla_decode"):

            def logged(*args, **kwargs):
                self.calls.append(name)
                return attr(*args, **kwargs)

            return logged
        return attr


def test_mla_reads_and_writes_its_cache_through_the_backend(deepseek) -> None:
    """Like every attention layer's, MLA's cache is the backend's to write and read:
    a backend that kept it elsewhere (or in another layout) would see every access.
    A chunk over a cached prefix stores then gathers; a decode stores then decodes.
    Blanking what the backend stores must change the result: the layer keeps no
    path of its own to the cache."""
    llm = LLM(deepseek[0], dtype="float32", block_size=16, num_kv_blocks=8)
    runner = llm.llm_engine.executor.model_runner
    attn = runner.model.model.layers[1].self_attn
    runner.backend = RecordingBackend(runner.backend)
    torch.manual_seed(0)
    x, positions = torch.randn(20, attn.o_proj.out_features), torch.arange(20)
    run(runner, one_sequence(12, 12, decode=False), lambda: attn(positions[:12], x[:12]))
    assert runner.backend.calls == ["store_latent"]  # a whole prompt: the new rows alone
    runner.backend.calls.clear()
    chunk = one_sequence(7, 19, decode=False)
    expected = run(runner, chunk, lambda: attn(positions[12:19], x[12:19]))
    assert runner.backend.calls == ["store_latent", "gather_latents"]
    runner.backend.calls.clear()
    run(runner, one_sequence(1, 20, decode=True), lambda: attn(positions[19:], x[19:]))
    assert runner.backend.calls == ["store_latent", "mla_decode"]

    runner.backend.store_latent = lambda *args: None  # the cache keeps its old rows
    runner.kv_cache.layers[1].kv_cache.rows.zero_()
    run(runner, one_sequence(12, 12, decode=False), lambda: attn(positions[:12], x[:12]))
    blank = run(runner, chunk, lambda: attn(positions[12:19], x[12:19]))
    assert not torch.allclose(blank, expected)
