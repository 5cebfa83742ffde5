"""DeepSeek-V4's MTP module and speculative decoding on V4.

transformers neither builds nor saves V4's MTP module, so the tests give a random
checkpoint one under DeepSeek's release names (mtp.0.*), built from the main
layers' tensors: a sliding-window layer's attention and a top-k layer's MoE, as
the release's MTP layer has, with new projections and norms. The oracle for its
logits is transformers' own V4 decoder layer, run between the MTP's input
projections and its hyper-head as DeepSeek's inference code runs its MTPBlock:

    x = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(streams_i))   (every stream)
    logits_{i+2} = head(norm(hc_head(layer(x))))

The oracle for speculative decoding is the one every drafter has: greedy tokens
equal transformers' greedy tokens, whatever the drafts were."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.utils import cdiv
from tests.engine.conftest import hf_greedy
from tests.engine.test_deepseek_v4 import CONFIGS, PROMPTS, SLIDING, build
from tests.engine.test_mtp import run

TOPK = "moe"


def add_mtp(path: Path, name: str, seed: int = 3) -> dict[str, torch.Tensor]:
    """Give the checkpoint at ``path`` an MTP module (mtp.0.*) and
    num_nextn_predict_layers 1; returns the module's tensors."""
    layers, ffns = CONFIGS[name]["layer_types"], CONFIGS[name]["mlp_layer_types"]
    attn_from, ffn_from = layers.index(SLIDING), ffns.index(TOPK)
    weights = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    mtp: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        for source, parts in ((attn_from, ("attn.", "attn_norm", "hc_")), (ffn_from, ("ffn",))):
            prefix = f"model.layers.{source}."
            if key.startswith(prefix) and key[len(prefix) :].startswith(parts):
                mtp[f"mtp.0.{key[len(prefix) :]}"] = tensor.clone()
    hidden = weights["model.embed_tokens.weight"].shape[1]
    for proj in ("e_proj", "h_proj"):
        mtp[f"mtp.0.{proj}.weight"] = torch.randn(hidden, hidden, generator=g) * hidden**-0.5
    for norm in ("enorm", "hnorm", "norm"):
        mtp[f"mtp.0.{norm}.weight"] = 1 + torch.randn(hidden, generator=g) * 0.2
    for part in ("fn", "base", "scale"):
        mtp[f"mtp.0.hc_head_{part}"] = weights[f"model.hc_head.hc_{part}"].clone()
    save_file(weights | mtp, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return mtp


@pytest.fixture(scope="module", params=["three-types", "sigmoid-topk"])
def with_mtp(request, tmp_path_factory) -> tuple[str, Path, torch.nn.Module, dict]:
    name = request.param
    path = tmp_path_factory.mktemp(f"deepseek-v4-mtp-{name}")
    hf = build(path, name)
    return name, path, hf, add_mtp(path, name)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_mtp_logits(hf, name: str, mtp: dict, ids: torch.Tensor) -> torch.Tensor:
    """Token i+2's logits at every position i < n - 1 of ``ids``, through
    transformers' V4 layers: the main model for the streams, then the MTP layer."""
    import transformers
    from transformers.masking_utils import create_sliding_window_causal_mask

    seen = []
    hook = hf.model.layers[-1].register_forward_hook(lambda m, a, out: seen.append(out))
    with torch.no_grad():
        hf(ids[None])
    hook.remove()
    streams = seen[0][:, :-1]  # [1, n - 1, hc, hidden]
    # The MTP layer inside a one-layer transformers model (a sliding window, top-k
    # MoE), saved and loaded as transformers loads a checkpoint, names and all.
    cfg = transformers.DeepseekV4Config(**{**hf.config.to_dict(), "num_hidden_layers": 1})
    cfg.layer_types, cfg.mlp_layer_types = [SLIDING], [TOPK]
    own = {k.removeprefix("mtp.0."): v for k, v in mtp.items()}
    layer = ("attn", "ffn", "hc_attn", "hc_ffn")  # attn_norm, ffn_norm too; not hc_head, norm
    state = {f"model.layers.0.{k}": v for k, v in own.items() if k.startswith(layer)}
    state |= {f"model.hc_head.hc_{p}": own[f"hc_head_{p}"] for p in ("fn", "base", "scale")}
    state |= {
        "model.embed_tokens.weight": hf.model.embed_tokens.weight.detach(),
        "model.norm.weight": own["norm.weight"],
        "lm_head.weight": hf.lm_head.weight.detach(),
    }
    with tempfile.TemporaryDirectory() as folder:
        cfg.save_pretrained(folder)
        save_file({k: v.contiguous() for k, v in state.items()}, f"{folder}/model.safetensors")
        one = transformers.DeepseekV4ForCausalLM.from_pretrained(folder).eval()
    eps, nxt = cfg.rms_norm_eps, ids[1:][None]
    with torch.no_grad():
        embeds = hf.model.embed_tokens(nxt)
        x = (rms(embeds, own["enorm.weight"], eps) @ own["e_proj.weight"].T)[:, :, None]
        x = x + rms(streams, own["hnorm.weight"], eps) @ own["h_proj.weight"].T
        positions = torch.arange(nxt.shape[1])[None]
        mask = create_sliding_window_causal_mask(
            config=one.config,
            inputs_embeds=embeds,
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        rope = one.model.rotary_emb
        position_embeddings = {
            kind: rope(embeds, position_ids=positions, layer_type=kind)
            for kind in ("main", "compress")
        }
        x = one.model.layers[0](
            x,
            position_embeddings=position_embeddings,
            position_ids=positions,
            attention_mask=mask,
            input_ids=nxt,
        )
        return one.lm_head(one.model.norm(one.model.hc_head(x)))[0]


def one_sequence(start: int, end: int, llm: LLM) -> AttentionMetadata:
    """Positions [start, end) of one sequence in token blocks 0, 1, ... and row
    blocks counted down from the pool's end (as test_deepseek_v4.one_sequence)."""
    config, pool = llm.llm_engine.config, llm.llm_engine.executor.model_runner.kv_cache
    rows = [pool.num_blocks - 1 - j for j in range(cdiv(end, config.kv_cache_groups.spans[0].span))]
    tables = torch.arange(cdiv(end, config.block_size), dtype=torch.int32)[None]
    return AttentionMetadata(
        slot_mapping=torch.arange(start, end),
        block_tables=tables,
        context_lens=torch.tensor([end], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, end - start], dtype=torch.int32),
        num_decodes=int(end - start == 1),
        context_lens_cpu=[end],
        query_lens_cpu=[end - start],
        group_tables=(tables, torch.tensor([rows], dtype=torch.int32)),
    )


def test_mtp_logits_match_transformers_layer(with_mtp) -> None:
    """The engine's MTP module, run through its own paged cache in two chunks and a
    decode (the window closing inside each), gives token i+2's logits within 1e-4
    of the reference at every position; its parameters are the file's."""
    name, path, hf, mtp = with_mtp
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    llm = LLM(path, dtype="float32", block_size=16, num_kv_blocks=12, speculative_config=spec)
    runner = llm.llm_engine.executor.model_runner
    model = runner.model
    assert model.has_mtp()
    torch.testing.assert_close(model.mtp[0].e_proj.weight, mtp["mtp.0.e_proj.weight"])
    ids = torch.tensor(PROMPTS[3][:69])
    expected = reference_mtp_logits(hf, name, mtp, ids)
    n = len(ids) - 1
    got = []
    for start, end in ((0, 37), (37, n - 1), (n - 1, n)):
        positions = torch.arange(start, end)
        meta = one_sequence(start, end, llm)
        hidden = run(runner, meta, lambda: model(ids[start:end], positions))  # noqa: B023
        step = lambda: model.mtp_hidden_states(positions, hidden, ids[start + 1 : end + 1])  # noqa: B023, E731
        normed, _ = run(runner, meta, step)
        got.append(model.draft_logits(normed))
    torch.testing.assert_close(torch.cat(got), expected, rtol=0, atol=1e-4)
    assert expected.std() > 0.1


def test_checkpoint_without_mtp_tensors_has_no_module(tmp_path) -> None:
    """transformers' checkpoint says num_nextn_predict_layers 1 but holds no MTP
    tensors: served without the module, and MTP drafting is refused by name."""
    build(tmp_path, "three-types")
    assert json.loads((tmp_path / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert not LLM(tmp_path, dtype="float32").llm_engine.executor.model_runner.model.has_mtp()
    spec = {"method": "mtp", "num_speculative_tokens": 1}
    with pytest.raises(ValueError, match="needs a model with multi-token prediction weights"):
        LLM(tmp_path, dtype="float32", speculative_config=spec)


REGIMES = {
    "mtp-1": ({"method": "mtp", "num_speculative_tokens": 1}, {"block_size": 4}),
    "mtp-3-chunked": (
        {"method": "mtp", "num_speculative_tokens": 3},
        {"block_size": 4, "max_num_batched_tokens": 13},
    ),
    "mtp-2-preemption": (
        {"method": "mtp", "num_speculative_tokens": 2},
        {"num_kv_blocks": 6, "block_size": 16, "max_num_batched_tokens": 32},
    ),
    # n-grams from one token up: a token the reply repeats is drafted again
    "ngram-3-prefix-hits": (
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
        {"block_size": 2, "max_num_seqs": 1},
    ),
}
REPLY = 60  # tokens a prompt: random weights repeat a token now and then


@pytest.fixture(scope="module")
def reference(with_mtp) -> list[list[int]]:
    return [hf_greedy(with_mtp[2], p, REPLY) for p in PROMPTS]


@pytest.mark.parametrize("regime", REGIMES, ids=list(REGIMES))
def test_drafts_leave_greedy_tokens_as_transformers_makes_them(with_mtp, reference, regime) -> None:
    """MTP and n-gram drafts, verified on V4's windowed, compressed cache, with
    chunked prefill, preemption and prefix hits: greedy tokens equal transformers'.
    A random MTP module's drafts are almost never right, so the n-gram regime is
    the one that accepts drafts: the replies repeat tokens, which it drafts again.
    Stats show each regime happened."""
    name, path, _, _ = with_mtp
    spec, options = REGIMES[regime]
    llm = LLM(path, dtype="float32", speculative_config=spec, **options)
    params = SamplingParams(temperature=0, max_tokens=REPLY)
    outs = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert outs == reference, (name, regime)
    stats = llm.stats
    assert stats.spec_decode.num_drafts > 0 and stats.window_freed_blocks > 0, stats
    if "chunked" in regime:
        assert stats.partial_prefills > 0, stats
    if "preemption" in regime:
        assert stats.preemptions > 0, stats
    if "prefix-hits" in regime:
        assert stats.prefix_cache_hit_tokens > 0, stats
    if spec["method"] == "ngram":
        assert stats.spec_decode.num_accepted_tokens > 0, stats  # repeats were drafted
    print(f"\n{name} {regime}: {stats.spec_decode}")
