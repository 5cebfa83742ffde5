"""DeepSeek-V4 against transformers: greedy tokens identical under every
scheduling regime (block sizes 4, 8 and 64, chunked prefill, preemption, prefix
hits, async scheduling) and in bfloat16, logits within 1e-4, the
hyper-connections' Sinkhorn matrices doubly stochastic, the lightning indexer's
rows equal to transformers'; the paged cache growing at the compressed rate,
prefix hits of whole row groups named by their tokens; and clear errors for
variants and engine options the engine does not implement.

Three tiny random configs, saved as transformers saves them (DeepSeek's own
tensor names), cover every part: the three attention layer types, hash-routed
and top-k MoE layers, hc_mult of 2, 3 and 4, YaRN on the compress RoPE, both
scoring functions. The prompts (40 to 100 tokens) are longer than the window and
than several HCA rows, and index_topk is below the compressed rows they make, so
every branch runs: raw rows falling out of the window (and their blocks given
back), compressed rows closing in prefill and in decode, the indexer keeping
some rows and dropping others.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.kv.compressed_cache import ROW_GROUP
from engine.layers.hyper_connection import sinkhorn
from engine.scheduler_output import HOLE
from engine.utils import cdiv
from tests.engine.conftest import EOS, VOCAB, build_tokenizer, hf_greedy, random_prompts
from tests.engine.test_mtp import run

MAX_TOKENS = 12
EXPERTS, TOP_K = 8, 2
PREFIX = random_prompts(1, seed=71, low=68, high=69)[0]  # shared: prefix-cache hits
PROMPTS = [PREFIX + p for p in random_prompts(2, seed=72, low=5, high=30)]
PROMPTS += random_prompts(2, seed=73, low=40, high=90)

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
CONFIGS = {
    "three-types": dict(
        layer_types=[SLIDING, CSA, HCA],
        mlp_layer_types=["hash_moe", "moe", "moe"],
        hc_mult=4,
        sliding_window=8,
        compress_rates={CSA: 4, HCA: 16},
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
        },
    ),
    "hash-only": dict(
        layer_types=[HCA, CSA],
        mlp_layer_types=["hash_moe", "hash_moe"],
        hc_mult=2,
        sliding_window=16,
        compress_rates={CSA: 4, HCA: 8},
    ),
    "sigmoid-topk": dict(
        layer_types=[CSA, SLIDING, HCA, CSA],
        mlp_layer_types=["moe", "hash_moe", "moe", "moe"],
        hc_mult=3,
        sliding_window=12,
        compress_rates={CSA: 4, HCA: 12},
        scoring_func="sigmoid",
    ),
}


def v4_config(**overrides):
    import transformers

    fields = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        moe_intermediate_size=32,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=24,
        partial_rotary_factor=0.25,  # rope on the last 8 of 32
        num_experts_per_tok=TOP_K,
        n_routed_experts=EXPERTS,
        n_shared_experts=1,
        max_position_embeddings=512,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=16,  # few exact-zero index scores: ties would be broken by row length
        index_head_dim=16,
        index_topk=4,  # below the 10 to 30 CSA rows of every prompt
        initializer_range=0.1,  # peaked logits: greedy choices are far from ties
        eos_token_id=EOS,
        pad_token_id=0,
        bos_token_id=1,
    )
    fields.update(overrides)
    fields["num_hidden_layers"] = len(fields["layer_types"])
    return transformers.DeepseekV4Config(**fields)


def randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers starts sinks, biases, norms, the hyper-connections' bases and
    scales, and tid2eid at zeros or ones: give each a value that counts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", ".base", "hc_base")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith(("norm.weight", "layernorm.weight", "scale")):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                rows = [torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(len(b))]
                b.copy_(torch.stack(rows))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def build(path: Path, name: str, **overrides) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(v4_config(**CONFIGS[name], **overrides)).eval()
    randomize(model, seed=1)
    model.save_pretrained(path)
    build_tokenizer(path)
    return model


def checkpoint_of(name: str, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp(f"deepseek-v4-{name}")
    return name, path, build(path, name)


@pytest.fixture(scope="module", params=list(CONFIGS))
def v4(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    return checkpoint_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=[n for n, c in CONFIGS.items() if CSA in c["layer_types"]])
def v4_csa(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """The configs with a CSA layer, whose indexer the tests below check."""
    return checkpoint_of(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def three_types(tmp_path_factory) -> tuple[str, Path, torch.nn.Module]:
    """One config, for the checks that need no more than one."""
    return checkpoint_of("three-types", tmp_path_factory)


@pytest.fixture(scope="module")
def reference(v4) -> list[list[int]]:
    return [hf_greedy(v4[2], p, MAX_TOKENS) for p in PROMPTS]


def generate(path: Path, prompts: list[list[int]], **config) -> tuple[list[list[int]], LLM]:
    llm = LLM(path, dtype="float32", **config)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)], llm


REGIMES = {
    "block-8": {"block_size": 8},
    "block-4": {"block_size": 4},
    "block-64": {"block_size": 64},
    # 13-token chunks: their boundaries fall inside CSA's 4-token and HCA's windows
    "chunked-prefill": {"max_num_batched_tokens": 13, "block_size": 4},
    # 6 blocks of 16: the longest request fits alone, but four running at once,
    # each with its window's token blocks and a row block, do not
    "preemption": {"num_kv_blocks": 6, "block_size": 16, "max_num_batched_tokens": 32},
    # blocks of 2: row spans of 36 to 48 tokens, shorter than the prompts' shared 68
    "prefix-hits": {"max_num_seqs": 1, "block_size": 2},
    "async-chunked": {"async_scheduling": True, "max_num_batched_tokens": 13, "block_size": 4},
}


@pytest.mark.parametrize("regime", REGIMES, ids=list(REGIMES))
def test_greedy_tokens_match_transformers(v4, reference, regime) -> None:
    tokens, llm = generate(v4[1], PROMPTS, **REGIMES[regime])
    for i, (out, ref) in enumerate(zip(tokens, reference)):
        assert out == ref, f"{v4[0]}, {regime}: prompt {i} differs"
    stats = llm.stats
    if regime != "block-64":  # a 64-token block is never wholly behind these windows
        assert stats.window_freed_blocks > 0, stats  # raw rows given back behind the window
    if regime in ("chunked-prefill", "async-chunked"):
        assert stats.partial_prefills > 0, stats
    if regime == "preemption":
        assert stats.preemptions > 0, stats
    if regime == "prefix-hits":
        assert stats.prefix_cache_hit_tokens > 0, stats


def one_sequence(n: int, context: int, llm: LLM) -> AttentionMetadata:
    """The last n of ``context`` tokens of one sequence, in token blocks 0, 1, ...
    of llm's pool, and its row blocks counted down from the pool's last block."""
    config, pool = llm.llm_engine.config, llm.llm_engine.executor.model_runner.kv_cache
    token_blocks = cdiv(context, config.block_size)
    row_blocks = [
        pool.num_blocks - 1 - j for j in range(cdiv(context, config.kv_cache_groups.spans[0].span))
    ]
    assert token_blocks <= row_blocks[-1], "the pool holds both tables"
    tables = torch.arange(token_blocks, dtype=torch.int32)[None]
    return AttentionMetadata(
        slot_mapping=torch.arange(context - n, context),
        block_tables=tables,
        context_lens=torch.tensor([context], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=int(n == 1),
        context_lens_cpu=[context],
        query_lens_cpu=[n],
        group_tables=(tables, torch.tensor([row_blocks], dtype=torch.int32)),
    )


def test_logits_within_1e4_of_transformers(v4) -> None:
    """Every position's logits of a prompt run as a 37-token chunk, a 30-token chunk
    and a decode (a window closing inside each), against transformers' one pass."""
    name, path, hf = v4
    llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=8)
    runner = llm.llm_engine.executor.model_runner
    model = runner.model
    ids = torch.tensor(PROMPTS[3][:68])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    got = []
    for start, end in ((0, 37), (37, 67), (67, 68)):
        meta = one_sequence(end - start, end, llm)
        positions = torch.arange(start, end)
        hidden = run(runner, meta, lambda: model(ids[start:end], positions))  # noqa: B023
        got.append(model.compute_logits(hidden))
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-4)
    assert expected.std() > 0.1  # logits that differ by token


def test_sparsity_changes_the_output(v4_csa, tmp_path) -> None:
    """The same weights with index_topk past every prompt's rows: other tokens.
    So the tests above pass only if the indexer drops the right rows."""
    reference = [hf_greedy(v4_csa[2], p, MAX_TOKENS) for p in PROMPTS]
    folder = tmp_path / "dense"
    shutil.copytree(v4_csa[1], folder)
    config = json.loads((folder / "config.json").read_text())
    config["index_topk"] = 64
    (folder / "config.json").write_text(json.dumps(config))
    dense, _ = generate(folder, PROMPTS, block_size=8)
    assert sum(d != r for d, r in zip(dense, reference)) >= 1, (dense, reference)


def test_prefix_hits_are_whole_row_spans(v4) -> None:
    """A second prompt shares 70 tokens with the first. A row block holds the
    compressed rows of one row span of tokens (36 to 48 here, in blocks of
    2), written until the span is full, so the prefix cache hits whole spans
    only. The hit ends inside a window of an HCA layer, whose rows then close from
    compressor states read from cached blocks. Each prompt runs alone on one
    engine; the cache's hash namespace names the span, so no other layout's
    blocks can match."""
    name, path, hf = v4
    first = PREFIX + [5, 6]
    second = PREFIX + [5, 6, 7, 8, 9]
    tokens, llm = generate(path, [first], block_size=2, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    out = llm.generate([second], params, use_tqdm=False)[0].token_ids
    span = llm.llm_engine.config.kv_cache_groups.spans[0].span
    assert 0 < llm.stats.prefix_cache_hit_tokens == 70 // span * span, (span, llm.stats)
    assert llm.llm_engine.config.model_identity.endswith(f":row-spans-of-{span}")
    assert [tokens[0], out] == [hf_greedy(hf, first, MAX_TOKENS), hf_greedy(hf, second, MAX_TOKENS)]


def hf_indexer_choices(hf: torch.nn.Module, ids: torch.Tensor) -> dict[int, torch.Tensor]:
    """transformers' indexer output [tokens, k] in each CSA layer, over one prompt."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Indexer

    seen: dict[int, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(
            lambda mod, args, out, i=i: seen.__setitem__(i, out[0])  # noqa: B023
        )
        for i, layer in enumerate(hf.model.layers)
        for module in layer.modules()
        if isinstance(module, DeepseekV4Indexer)
    ]
    with torch.no_grad():
        hf(ids[None])
    for hook in hooks:
        hook.remove()
    return seen


def test_indexer_keeps_the_rows_transformers_keeps(v4_csa) -> None:
    """Over the same prompt, every CSA layer's indexer keeps, for every query, the
    same compressed rows as transformers' (as sets: topk's order among them is
    not what attention reads)."""
    _, path, hf = v4_csa
    ids = torch.tensor(PROMPTS[3])
    expected = hf_indexer_choices(hf, ids)
    llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=8)
    runner = llm.llm_engine.executor.model_runner
    seen: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(runner.model.layers):
        if layer.attn.indexer is not None:
            layer.attn.indexer.register_forward_hook(
                lambda mod, args, out, i=i: seen.__setitem__(i, out)  # noqa: B023
            )
    meta = one_sequence(len(ids), len(ids), llm)
    run(runner, meta, lambda: runner.model(ids, torch.arange(len(ids))))
    assert sorted(seen) == sorted(expected) and seen
    for i, ours in seen.items():
        theirs = expected[i]
        for t in range(len(ids)):
            mine = sorted(r for r in ours[t].tolist() if r >= 0)
            assert mine == sorted(r for r in theirs[t].tolist() if r >= 0), (i, t)
        assert (ours >= 0).sum(1).max() == ours.shape[1]  # some queries had rows to drop


def layer_inputs(llm: LLM, ids: torch.Tensor) -> list[torch.Tensor]:
    """The residual streams [tokens, hc_mult, hidden] entering each layer, over one prompt."""
    runner = llm.llm_engine.executor.model_runner
    seen: list[torch.Tensor] = []
    hooks = [
        layer.register_forward_pre_hook(lambda mod, args: seen.append(args[1]))
        for layer in runner.model.layers
    ]
    run(
        runner,
        one_sequence(len(ids), len(ids), llm),
        lambda: runner.model(ids, torch.arange(len(ids))),
    )
    for hook in hooks:
        hook.remove()
    return seen


def test_sinkhorn_matrices_are_doubly_stochastic(v4) -> None:
    """Every hyper-connection's comb, on the streams a real prompt brings it, equals
    transformers' and sums to 1 along columns (normalised last) within hc_eps plus
    float32 rounding. Its rows are off by up to about 1e-2 on these random weights:
    hc_sinkhorn_iters=20 (transformers' and DeepSeek's count) is not a convergence
    criterion. Run to convergence, the same projection is doubly stochastic both ways."""
    name, path, hf = v4
    llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=8)
    model = llm.llm_engine.executor.model_runner.model
    eps, n = model.v4.hc_eps, CONFIGS[name]["hc_mult"]
    inputs = layer_inputs(llm, torch.tensor(PROMPTS[3]))
    for streams, ours, theirs in zip(inputs, model.layers, hf.model.layers):
        with torch.no_grad():
            _, _, comb = ours.hc_attn.weights(streams)
            _, ref_comb, _ = theirs.attn_hc(streams[None])
        torch.testing.assert_close(comb, ref_comb[0], rtol=0, atol=1e-6)
        assert (comb.sum(-2) - 1).abs().max() <= 2 * eps  # 1 - eps exactly, and rounding
        assert comb.min() > 0 and (comb - 1 / n).abs().max() > 0.01  # not uniform
    logits = torch.randn(100, n, n, generator=torch.Generator().manual_seed(0)) * 2
    converged = sinkhorn(logits, 2000, eps)
    for axis in (-1, -2):
        assert (converged.sum(axis) - 1).abs().max() <= 2 * eps


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("num_key_value_heads", 2, "unsupported num_key_value_heads 2"),
        ("scoring_func", "softmax", "unsupported scoring_func 'softmax'"),
        ("norm_topk_prob", False, "unsupported norm_topk_prob False"),
        ("hidden_act", "gelu", "unsupported hidden_act 'gelu'"),
        (
            "quantization_config",
            {"quant_method": "awq"},
            "unsupported quantization_config quant_method 'awq'",
        ),
        ("layer_types", ["full_attention"] * 3, "layer_types must name 3 layers"),
        ("mlp_layer_types", ["dense"] * 3, "mlp_layer_types must name 3 layers"),
    ],
)
def test_unsupported_variant_is_named_at_load(tmp_path, field, value, message) -> None:
    folder = tmp_path / "m"
    build(folder, "three-types")
    config = json.loads((folder / "config.json").read_text())
    config[field] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(folder, dtype="float32")


@pytest.mark.parametrize(
    ("option", "name"),
    [
        ({"kv_window": (0, 16)}, "kv_window is not supported on DeepSeek-V4"),
        ({"kv_store": "/nonexistent/store"}, "kv_store is not supported on DeepSeek-V4"),
        (
            {
                "speculative_config": {
                    "method": "draft_model",
                    "model": str(
                        Path(__file__).resolve().parents[2] / "snippets/models/deepinfer-tiny"
                    ),
                    "num_speculative_tokens": 2,
                }
            },
            "speculative_config method 'draft_model' is not supported on DeepSeek-V4",
        ),
        (
            {"kv_cache_dtype": "fp8_e4m3"},
            "kv_cache_dtype='fp8_e4m3' is not supported on DeepSeek-V4",
        ),
    ],
)
def test_unsupported_engine_option_is_named(three_types, option, name) -> None:
    with pytest.raises(ValueError, match=name):
        LLM(three_types[1], dtype="float32", **option)


def held_blocks_while_generating(llm: LLM, prompt: list[int], n: int) -> list[tuple[int, int]]:
    """(tokens computed, blocks the request holds) after every step of one request."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    engine.add_request("long", prompt, params)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            blocks = sum(1 for b in seq.block_table if b != HOLE) + len(seq.block_tables[ROW_GROUP])
            held.append((seq.num_computed_tokens, blocks))
    return held


def test_blocks_grow_at_the_compressed_rate(tmp_path) -> None:
    """A 4,000-token sequence (a 3,900-token prompt in chunks of 64, then 100
    generated) runs in a pool of 100 blocks of 4, room for 400 tokens at the token
    rate: the blocks a request holds grow by one row block per row span (96 tokens
    here), not one per block of tokens, at every step of prefill and decode
    alike. Bytes per token from the pool, beside a dense MLA cache of the same
    width (one head_dim row per token and layer, every token kept)."""
    build(tmp_path, "three-types", max_position_embeddings=4096)
    llm = LLM(tmp_path, dtype="float32", block_size=4, num_kv_blocks=100,
              max_num_batched_tokens=64)  # fmt: skip
    assert llm.llm_engine.max_model_len >= 4000 > 100 * 4
    prompt = (PROMPTS[3] * 100)[:3900]
    held = held_blocks_while_generating(llm, prompt, 100)
    span = llm.llm_engine.config.kv_cache_groups.spans[0].span
    cfg = llm.llm_engine.config.hf_config
    assert held[-1][0] == 3998  # recorded while running: all but the last two tokens
    steady = held[2:]  # once the window's blocks before the chunk are there
    for (t0, b0), (t1, b1) in zip(steady, steady[8:]):  # growth over 8 steps at a time
        assert b1 - b0 <= (t1 - t0) // span + 2, (t0, b0, t1, b1)
    t1, b1 = held[-1]  # decoding: every span's row block, and the window's token blocks
    window = cdiv(cfg.v4.window_tokens(), 4) + 1
    assert cdiv(t1, span) <= b1 <= cdiv(t1, span) + window, (t1, b1)
    pool = llm.llm_engine.executor.model_runner.kv_cache
    ours = b1 * pool.block_bytes() / t1
    dense_mla = cfg.num_hidden_layers * cfg.head_dim * 4  # float32
    print(
        f"\n{t1} tokens: {b1} blocks held ({cdiv(t1, 4)} at the token rate); "
        f"{ours:.0f} bytes/token from the pool, {pool.block_bytes() / span:.0f} in the "
        f"limit; dense MLA of the same width {dense_mla} bytes/token"
    )
    assert ours < dense_mla


def test_legacy_config_fields_read_as_transformers_reads_them(tmp_path) -> None:
    """DeepSeek's own config spellings (compress_ratios, num_hash_layers,
    qk_rope_head_dim, a flat YaRN rope_scaling) give the layout transformers
    derives from them."""
    from engine.config.deepseek_v4 import parse_v4

    legacy = dict(
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=32,
        compress_ratios=[0, 4, 128, 4],
        num_hash_layers=2,
        qk_rope_head_dim=8,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        compress_rope_theta=50000.0,
        rope_theta=10000.0,
    )
    import transformers

    ours = parse_v4(legacy)
    theirs = transformers.DeepseekV4Config(**legacy)
    assert list(ours.layer_types) == theirs.layer_types
    assert list(ours.mlp_layer_types) == theirs.mlp_layer_types
    assert ours.rope_dim == theirs.qk_rope_head_dim == 8
    compress = theirs.rope_parameters["compress"]
    assert ours.compress_rope.theta == compress["rope_theta"] == 50000.0
    assert ours.compress_rope.yarn is not None and ours.compress_rope.yarn["factor"] == 4.0
    assert ours.compress_rope.yarn["attention_factor"] == compress["attention_factor"] == 1.0
    assert ours.main_rope.theta == theirs.rope_parameters["main"]["rope_theta"]


def test_bfloat16_matches_transformers(three_types) -> None:
    """In bfloat16, with transformers keeping its float32 parts (norms, sinks, the
    compressors' biases, mHC) as the engine does: the same greedy tokens under
    chunked prefill, and the last prompt position's logits within 2e-2. One
    config, the one with all three layer types: the dtype's path is shared."""
    import transformers

    name, path, _ = three_types
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = PROMPTS[2:]
    llm = LLM(path, dtype="bfloat16", block_size=8, max_num_batched_tokens=13)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert tokens == [hf_greedy(hf, p, MAX_TOKENS) for p in prompts]
    assert llm.stats.partial_prefills > 0
    runner, ids = llm.llm_engine.executor.model_runner, torch.tensor(PROMPTS[3])
    with torch.no_grad():
        expected = hf(ids[None]).logits[0, -1].float()
    meta = one_sequence(len(ids), len(ids), llm)
    hidden = run(runner, meta, lambda: runner.model(ids, torch.arange(len(ids))))
    got = runner.model.compute_logits(hidden)[-1].float()
    torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)


def test_deepseek_native_names_load(three_types, tmp_path) -> None:
    """The checkpoint under DeepSeek's release names (no ``model.`` prefix, embed,
    hc_head_fn) gives the same tokens; a checkpoint missing a tensor is refused,
    naming it. (MTP tensors: test_deepseek_v4_mtp.py.)"""
    from safetensors.torch import load_file, save_file

    _, path, hf = three_types
    weights = load_file(path / "model.safetensors")
    native = {}
    for key, tensor in weights.items():
        key = key.removeprefix("model.").replace("embed_tokens.", "embed.")
        native[key.replace("hc_head.hc_", "hc_head_")] = tensor
    folder = tmp_path / "native"
    shutil.copytree(path, folder)
    save_file(native, folder / "model.safetensors")
    tokens, _ = generate(folder, PROMPTS[:2], block_size=8)
    assert tokens == [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS[:2]]
    del native["layers.1.attn.indexer.compressor.ape"]
    save_file(native, folder / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"lacks weights for: layers\.1\.attn\.indexer\.compressor\.ape"
    ):
        LLM(folder, dtype="float32")


def test_a_row_block_is_never_found_behind_another_spans_tokens(three_types) -> None:
    """A and B share 72 tokens (row span 0 of 48 tokens, in blocks of 2, and half of
    span 1), then differ; C repeats B. Were row blocks named by their own span's
    tokens, or by its first block's, C would find A's span-1 row block (its rows
    pooled from A's tokens) behind B's token blocks. Named by the chain through
    their span's last block, C hits B's two whole spans, and its tokens are
    transformers'."""
    _, path, hf = three_types
    g = torch.Generator().manual_seed(5)
    shared, tail_a, tail_b = (
        torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (72, 56, 56)
    )
    prompts = [shared + tail_a + [7], shared + tail_b + [7], shared + tail_b + [9, 10]]
    llm = LLM(path, dtype="float32", block_size=2, max_num_seqs=1)
    span = llm.llm_engine.config.kv_cache_groups.spans[0].span
    params = SamplingParams(temperature=0, max_tokens=4)
    outs, hits = [], []
    for prompt in prompts:
        before = llm.stats.prefix_cache_hit_tokens
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0].token_ids)
        hits.append(llm.stats.prefix_cache_hit_tokens - before)
    assert span == 48 and hits == [0, 48, 96]
    assert outs == [hf_greedy(hf, p, 4) for p in prompts]


def test_a_hit_needs_only_the_token_blocks_its_window_reads(three_types) -> None:
    """A long prompt runs; then its first token blocks leave the prefix cache, as a
    busy pool evicts blocks the request's own window gave back long before. A
    prompt sharing its first 150 tokens still resumes from every whole row span
    (the row blocks, and the token blocks of the window before the hit's end; the
    earlier ones come back as HOLEs), and its tokens are transformers'."""
    from engine.kv.hashing import chain_hash

    _, path, hf = three_types
    g = torch.Generator().manual_seed(9)
    shared = torch.randint(3, VOCAB, (150,), generator=g).tolist()
    first, second = shared + [7], shared + [9, 10]
    llm = LLM(path, dtype="float32", block_size=2, max_num_seqs=1)
    blocks, span = llm.llm_engine.block_manager, llm.llm_engine.config.kv_cache_groups.spans[0].span
    params = SamplingParams(temperature=0, max_tokens=4)
    llm.generate([first], params, use_tqdm=False)
    parent = blocks.root
    for i in range(40):  # evict the first 40 token blocks (80 tokens)
        parent = chain_hash(parent, tuple(shared[2 * i : 2 * i + 2]))
        block = blocks.blocks[blocks.cached_blocks.pop(parent)]
        block.hash, block.token_ids = None, ()
    before = llm.stats.prefix_cache_hit_tokens
    out = llm.generate([second], params, use_tqdm=False)[0].token_ids
    assert llm.stats.prefix_cache_hit_tokens - before == 150 // span * span == 144
    assert out == hf_greedy(hf, second, 4)
