"""DeepSeek-V3.2's sparse attention (DSA) against transformers: greedy tokens
identical under every scheduling regime, with index_topk well below the context;
the indexer's chosen positions equal to transformers' top-k on the same inputs;
the indexer's keys paged in the layer's own cache; the torch sparse decode
against float64; and clear errors for DSA settings that cannot apply.

The tiny model's indexer has 16 heads: with few heads, many tokens score
exactly 0 (every head's ReLU closed), and which of several tied tokens
torch.topk keeps depends on the length of the row it sorts, so transformers
run in chunks may keep another of them than run whole. The engine breaks exact
ties by position, the lower winning, in every regime
(test_ties_go_to_the_lower_position_whatever_transformers_keeps here;
test_sparse_selection.py with 2, 4 and 16 heads end to end).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchBackend
from engine.attention.torch_ops import rotary_embedding
from engine.kv.kv_cache import LatentKV, MLACacheSpec
from engine.kv.sparse_cache import IndexedLatentKV, IndexedLatentSpec
from engine.layers.indexer import Indexer, index_scores
from engine.layers.rotary_embedding import RotaryEmbedding
from engine.utils import cdiv
from tests.conftest import ROOT
from tests.engine.conftest import EOS, VOCAB, build_tokenizer, hf_greedy, random_prompts

TOPK = 8  # well below every context the tests run (44 to 96 tokens)
MAX_TOKENS = 16
INDEX = dict(index_topk=TOPK, index_n_heads=16, index_head_dim=32)

PREFIX = random_prompts(1, seed=61, low=40, high=41)[0]  # shared: prefix-cache hits
PROMPTS = [PREFIX + p for p in random_prompts(2, seed=62, low=4, high=24)]
PROMPTS += random_prompts(2, seed=63, low=40, high=80)


def dsa_config(**overrides):
    import transformers

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,  # a dense layer, then a MoE layer
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        initializer_range=0.1,  # peaked logits: greedy choices are far from ties
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=1,
        tie_word_embeddings=False,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        moe_intermediate_size=32,
        n_routed_experts=8,
        n_group=4,
        topk_group=2,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        **INDEX,
    )
    return transformers.DeepseekV32Config(**{**fields, **overrides})


@pytest.fixture(scope="module")
def dsa(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny random DeepseekV32ForCausalLM, saved as transformers saves it."""
    import transformers

    path = tmp_path_factory.mktemp("deepseek-v32")
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(dsa_config()).eval()
    with torch.no_grad():  # transformers starts these at ones and zeros: make them count
        for layer in model.model.layers:
            layer.self_attn.indexer.k_norm.weight.normal_(1, 0.1)
            layer.self_attn.indexer.k_norm.bias.normal_(0, 0.1)
        model.model.layers[1].mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    model.save_pretrained(path)
    build_tokenizer(path)
    return path, model


@pytest.fixture(scope="module")
def reference(dsa) -> list[list[int]]:
    return [hf_greedy(dsa[1], p, MAX_TOKENS) for p in PROMPTS]


def generate(path: Path, **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)], llm


CONFIGS = {
    "defaults": {"block_size": 8},
    "chunked-prefill": {"max_num_batched_tokens": 16, "block_size": 4},
    "preemption": {"num_kv_blocks": 16, "block_size": 8},
    "prefix-hits": {"max_num_seqs": 1, "block_size": 4},
    "torch-backend": {"attention_backend": "torch", "max_num_batched_tokens": 16, "block_size": 4},
}


@pytest.mark.parametrize("config", CONFIGS, ids=list(CONFIGS))
def test_greedy_tokens_match_transformers(dsa, reference, config) -> None:
    tokens, llm = generate(dsa[0], **CONFIGS[config])
    for i, (out, ref) in enumerate(zip(tokens, reference)):
        assert out == ref, f"{config}: prompt {i} differs"
    stats = llm.stats
    if config in ("chunked-prefill", "torch-backend"):
        assert stats.partial_prefills > 0, stats
    if config == "preemption":
        assert stats.preemptions > 0, stats
    if config in ("defaults", "prefix-hits"):
        assert stats.prefix_cache_hit_tokens > 0, stats


def test_sparsity_changes_the_output(dsa, reference, tmp_path) -> None:
    """The same weights with index_topk past every context (dense MLA): other
    tokens. So the tests above pass only if the right tokens are dropped."""
    folder = tmp_path / "dense"
    shutil.copytree(dsa[0], folder)
    config = json.loads((folder / "config.json").read_text())
    config["index_topk"] = 512
    (folder / "config.json").write_text(json.dumps(config))
    dense, _ = generate(folder, block_size=8)
    assert sum(d != r for d, r in zip(dense, reference)) >= 2, (dense, reference)


TRITON_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import engine.kernels
    from engine import LLM, SamplingParams

    calls = []
    kernel = engine.kernels.sparse_mla_decode
    engine.kernels.sparse_mla_decode = lambda *a, **k: calls.append(1) or kernel(*a, **k)
    path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = LLM(path, dtype="float32", attention_backend="triton",
              max_num_batched_tokens=16, block_size=4, max_num_seqs=2)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    s = llm.stats
    print(json.dumps({"tokens": [o.token_ids for o in outs], "kernel_calls": len(calls),
                      "partial": s.partial_prefills, "hits": s.prefix_cache_hit_tokens}))
    """
)


@pytest.mark.triton
def test_triton_backend_matches_transformers(dsa, reference) -> None:
    """Chunked prefill, a prefix hit and decodes through the sparse MLA decode
    kernel, in Triton's interpreter."""
    n, prompts = 8, PROMPTS[:3]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(dsa[0]), json.dumps(prompts), str(n)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens"] == [r[:n] for r in reference[:3]]  # greedy: a prefix of 16
    assert result["kernel_calls"] > 0 and result["partial"] > 0 and result["hits"] > 0, result


# ---------------------------------------------------------------------------- the indexer


def indexer_pair(heads: int, seed: int) -> tuple[torch.nn.Module, Indexer, object]:
    """transformers' DeepseekV32Indexer with random weights, the engine's with the
    same weights, and transformers' rotary embedding for their positions."""
    from transformers.models.deepseek_v32.modeling_deepseek_v32 import (
        DeepseekV32Indexer,
        DeepseekV32RotaryEmbedding,
    )

    cfg = dsa_config(index_n_heads=heads)
    torch.manual_seed(seed)
    hf = DeepseekV32Indexer(cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.max_position_embeddings, 10000.0, None)
    ours = Indexer(cfg.hidden_size, cfg.q_lora_rank, heads, 32, 16, TOPK, rope)
    ours.load_state_dict(hf.state_dict())
    return hf, ours, DeepseekV32RotaryEmbedding(cfg)


class OneSequence:
    """The engine's indexer over one sequence's tokens, run in steps as the model
    runner runs them (block size 8), its keys kept in a DSA layer's cache."""

    def __init__(self, indexer: Indexer, x: torch.Tensor, q_latent: torch.Tensor) -> None:
        self.indexer, self.x, self.q_latent, self.block_size = indexer, x, q_latent, 8
        spec = IndexedLatentSpec(MLACacheSpec(32, 16, torch.float32), 32)
        self.cache = spec.allocate(cdiv(len(x), 8), 8, torch.device("cpu"))
        for t in self.cache.tensors():
            t.zero_()
        self.backend = TorchBackend(8)

    def step(self, first: int, n: int) -> torch.Tensor:
        """The chosen positions of tokens first .. first + n - 1, the earlier ones cached."""
        end = first + n
        meta = AttentionMetadata(
            slot_mapping=torch.arange(first, end),
            block_tables=torch.arange(cdiv(end, 8), dtype=torch.int32)[None],
            context_lens=torch.tensor([end], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
            num_decodes=int(n == 1),
            context_lens_cpu=[end],
            query_lens_cpu=[n],
        )
        positions = torch.arange(first, end)
        with (
            torch.no_grad(),
            forward_context(meta, self.backend.build_metadata(meta), self.backend),
        ):
            return self.indexer(positions, self.x[first:end], self.q_latent[first:end], self.cache)


def hf_choice(hf, rope, x: torch.Tensor, q_latent: torch.Tensor) -> torch.Tensor:
    """transformers' top-k [tokens, topk] for one whole prompt."""
    positions = torch.arange(len(x))[None]
    causal = torch.ones(len(x), len(x), dtype=torch.bool).tril()[None]
    with torch.no_grad():
        return hf(x[None], q_latent[None], rope(x[None], positions), causal, positions)[0]


def chosen_sets(chosen: torch.Tensor) -> list[list[int]]:
    """Each query's chosen positions as a sorted list, without -1 and without the
    positions after it (which transformers' top-k holds for short contexts,
    where its causal mask hides them from attention)."""
    return [sorted(p for p in row.tolist() if 0 <= p <= q) for q, row in enumerate(chosen)]


@pytest.mark.parametrize("steps", [[60], [25, 20, 14, 1]], ids=["whole", "chunks+decode"])
def test_indexer_chooses_transformers_top_k(steps) -> None:
    hf, ours, rope = indexer_pair(heads=16, seed=1)
    x, q_latent = torch.randn(60, 64), torch.randn(60, 24)
    expected = chosen_sets(hf_choice(hf, rope, x, q_latent))
    run = OneSequence(ours, x, q_latent)
    firsts = [sum(steps[:i]) for i in range(len(steps))]
    chosen = torch.cat([run.step(first, n) for first, n in zip(firsts, steps)])
    assert chosen.shape == (60, TOPK)
    assert chosen_sets(chosen) == expected
    # Queries with TOPK or more tokens before them keep TOPK; the others keep all.
    assert [len(s) for s in chosen_sets(chosen)] == [min(q + 1, TOPK) for q in range(60)]
    valid = chosen >= 0  # valid positions first, then -1: what the decode kernel reads
    assert torch.equal(valid, valid.cummin(dim=1).values)


def test_ties_go_to_the_lower_position_whatever_transformers_keeps() -> None:
    """One indexer head and negative head weights: every token whose one score is
    closed by the ReLU scores exactly 0, the best score, so most rows hold more
    tied best tokens than TOPK. The engine keeps the lower positions among ties
    (best first, then by position), the same run whole or in chunks; transformers'
    torch.topk keeps the same tokens above the tie and an arbitrary choice of the
    tied ones, so its rows differ from the engine's only among tied tokens."""
    hf, ours, rope = indexer_pair(heads=1, seed=2)
    with torch.no_grad():
        hf.weights_proj.weight.abs_().neg_()
        ours.weights_proj.weight.copy_(hf.weights_proj.weight)
    x, q_latent = torch.randn(60, 64).abs(), torch.randn(60, 24)  # x >= 0: weights < 0
    run = OneSequence(ours, x, q_latent)
    chosen = run.step(0, 60)
    chunked = OneSequence(ours, x, q_latent)
    steps = [(0, 25), (25, 20), (45, 14), (59, 1)]
    assert torch.equal(torch.cat([chunked.step(first, n) for first, n in steps]), chosen)
    scores = index_scores(*run_inputs(ours, x, q_latent, run.cache), ours.scale)
    theirs = chosen_sets(hf_choice(hf, rope, x, q_latent))
    tied_rows = 0
    for t, (row, other) in enumerate(zip(chosen.tolist(), theirs)):
        ranked = sorted(range(t + 1), key=lambda s: (-scores[t, s].item(), s))[:TOPK]
        assert row[: len(ranked)] == ranked, t  # the rule: best first, ties to the lower
        edge = scores[t, ranked[-1]]
        above = [s for s in ranked if scores[t, s] > edge]
        assert set(above) <= set(other) and len(other) == len(ranked), t
        tied = (scores[t, : t + 1] == edge).sum() > (scores[t, ranked] == edge).sum()
        tied_rows += int(tied)
        if not tied:
            assert sorted(ranked) == other, t
    assert tied_rows > 20, tied_rows  # rows where the choice among ties decides


def run_inputs(indexer: Indexer, x, q_latent, cache: IndexedLatentKV):
    """The rotated queries and head weights the indexer scored, and its cached keys."""
    q = indexer.wq_b(q_latent).view(len(x), indexer.num_heads, indexer.head_dim)
    r = indexer.rope_dim
    cos_sin = indexer.rotary_emb.cos_sin_cache
    q_rot, _ = rotary_embedding(torch.arange(len(x)), q[..., :r], q[:, :1, :r], cos_sin)
    q = torch.cat([q_rot, q[..., r:]], dim=-1)
    weights = indexer.weights_proj(x) * indexer.num_heads**-0.5
    keys = cache.index_keys.flatten(0, 1)[: len(x)]
    return q.detach(), weights.detach(), keys


# ---------------------------------------------------------------------------- the cache


def test_indexer_keys_are_paged_beside_the_latents(dsa) -> None:
    """Each layer's blocks hold a latent row and an indexer key per token; both are
    written, and both travel with read_blocks and write_blocks."""
    llm = LLM(dsa[0], dtype="float32", block_size=4, num_kv_blocks=32)
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    pool = llm.llm_engine.executor.model_runner.kv_cache
    rank, rope, index_dim = 32, 16, INDEX["index_head_dim"]
    for spec, layer in zip(pool.specs, pool.layers):
        assert isinstance(spec, IndexedLatentSpec)
        assert spec.index_bytes(1) == index_dim * 4  # float32: 128 bytes a token
        assert spec.block_bytes(4) == 4 * (rank + rope + index_dim) * 4
        rows, keys = layer.kv_cache.tensors()
        assert keys.shape == (32, 4, index_dim)
        assert keys[0].abs().sum() > 0 and rows[0].abs().sum() > 0  # the prompt's first block
    data = pool.read_blocks([0, 1])
    pool.write_blocks([5, 6], data)
    for layer in pool.layers:
        assert torch.equal(layer.kv_cache.index_keys[5:7], layer.kv_cache.index_keys[0:2])


def sparse_mla_decode_reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    chosen: torch.Tensor,
    rank: int,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA decode over the chosen rows, in float64, one decode at a time."""
    out = torch.empty((*q.shape[:2], rank), dtype=torch.float64)
    block_size = cache.shape[1]
    for i, row in enumerate(chosen.tolist()):
        pos = torch.tensor([p for p in row if p >= 0])
        slots = block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        rows = cache.flatten(0, 1)[slots].double()  # [chosen, rank + rope]
        weights = (q[i].double() @ rows.T * scale).softmax(-1)  # [heads, chosen]
        out[i] = weights @ rows[:, :rank]
    return out


def random_sparse_decode(
    contexts: list[int], k: int, block_size: int, rank: int, rope: int, heads: int
) -> tuple[torch.Tensor, ...]:
    """q, a paged cache NaN outside the chosen rows, block tables padded with -1,
    and each decode's chosen positions (a random k of its context, or all of a
    shorter one, in random order, then -1)."""
    blocks = [cdiv(c, block_size) for c in contexts]
    order = torch.randperm(sum(blocks) + 2).int()
    tables = torch.full((len(contexts), max(blocks) + 1), -1, dtype=torch.int32)
    cache = torch.full((sum(blocks) + 2, block_size, rank + rope), float("nan"))
    chosen = torch.full((len(contexts), k), -1, dtype=torch.int64)
    start = 0
    for i, (context, n) in enumerate(zip(contexts, blocks)):
        tables[i, :n] = order[start : start + n]
        start += n
        picks = torch.randperm(context)[:k]
        chosen[i, : len(picks)] = picks
        slots = tables[i].long()[picks // block_size] * block_size + picks % block_size
        cache.view(-1, rank + rope)[slots] = torch.randn(len(picks), rank + rope)
    q = torch.randn(len(contexts), heads, rank + rope)
    return q, cache, tables, chosen


def test_torch_sparse_decode_matches_float64() -> None:
    """The torch backend's sparse decode reads the chosen rows alone: every other
    slot is NaN, and the output has none."""
    torch.manual_seed(3)
    q, cache, tables, chosen = random_sparse_decode([5, 40, 73], 16, 4, 32, 16, 4)
    out = TorchBackend(4).sparse_mla_decode(q, LatentKV(cache), 32, chosen, tables, 0.2)
    ref = sparse_mla_decode_reference(q, cache, tables, chosen, 32, 0.2)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------- bad configuration


def edited(dsa, tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "m"
    shutil.copytree(dsa[0], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    return folder


@pytest.mark.parametrize("field", ["index_topk", "index_n_heads"])
def test_dsa_settings_on_a_model_without_an_indexer(dsa, tmp_path, field) -> None:
    config = json.loads((dsa[0] / "config.json").read_text())
    others = {k: v for k, v in config.items() if k not in INDEX or k == field}
    folder = tmp_path / "v3"
    shutil.copytree(dsa[0], folder)
    (folder / "config.json").write_text(
        json.dumps({**others, "architectures": ["DeepseekV3ForCausalLM"]})
    )
    with pytest.raises(ValueError, match=f"{field} is set in config.json, but Deepseek"):
        LLM(folder, dtype="float32")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"index_topk": 0}, "index_topk must be at least 1, got 0"),
        ({"q_lora_rank": None}, "q_lora_rank is null"),
        ({"index_head_dim": 8}, "index_head_dim 8 is smaller than qk_rope_head_dim 16"),
    ],
)
def test_bad_dsa_settings_are_named(dsa, tmp_path, changes, message) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(edited(dsa, tmp_path, **changes), dtype="float32")


def test_a_quantized_cache_on_sparse_attention_is_refused_by_name(dsa) -> None:
    with pytest.raises(ValueError, match="sparse attention"):
        LLM(str(dsa[0]), dtype="float32", kv_cache_dtype="fp8_e4m3", num_kv_blocks=16)


def test_a_kv_window_combines_with_sparse_attention(dsa, reference) -> None:
    """A window wider than every context changes nothing; one that bites frees
    blocks while the indexer chooses among the tokens still held."""
    wide, _ = generate(dsa[0], block_size=4, kv_window=(4, 512))
    assert wide == reference
    tokens, llm = generate(dsa[0], block_size=4, kv_window=(4, 16))
    assert llm.stats.window_freed_blocks > 0
    assert all(len(t) == MAX_TOKENS for t in tokens)


def test_compile_decode_skips_what_it_cannot_compile(dsa) -> None:
    """The indexer's chosen positions have no opaque operator: compile_decode=True
    is refused with the reason, and None (what `deepinfer serve` passes) runs eager."""
    path, _ = dsa
    with pytest.raises(ValueError, match="DeepseekV32ForCausalLM does not support it"):
        LLM(path, dtype="float32", num_kv_blocks=8, compile_decode=True)
    llm = LLM(path, dtype="float32", num_kv_blocks=8, compile_decode=None)
    assert llm.llm_engine.executor.model_runner.compiled is None
