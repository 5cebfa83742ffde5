"""DeepSeek-V3's config defaults, the MoE router's weights and expert parallelism's
gather, each where the other tests do not reach:

- a config.json that omits a field with a default is read as transformers'
  DeepseekV3Config reads it (DeepSeek's own config.json has no rope_interleave);
- the router scales the top-k weights by routed_scaling_factor whether or not it
  normalises them (norm_topk_prob), against a float64 brute force and against
  transformers' MoE layer;
- an expert-parallel MoE layer gives every rank the single-process output when the
  batch does not divide evenly among the ranks (the all-gather drops each rank's
  padding), on real gloo process groups of 3 and 2 ranks.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from engine.config.model import ModelConfig
from engine.distributed.expert_parallel import ExpertParallel, TrafficCounters
from engine.distributed.placement import ExpertPlacement
from engine.layers.gate import GroupedTopKRouter
from engine.layers.moe import MoE
from tests.engine.conftest import random_prompts
from tests.engine.test_moe import HIDDEN, INTER, hf_config

# --- 1. config.json defaults, with transformers as the oracle ---------------------

# A tiny DeepSeek-V3 config.json in which every field that has a default holds a value
# other than transformers' default, so that omitting it changes what is read.
BASE_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 320,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 24,
    "moe_intermediate_size": 32,
    "n_routed_experts": 16,
    "num_experts_per_tok": 3,
    "eos_token_id": 2,
    # The fields with defaults (transformers' default in the comment):
    "q_lora_rank": 24,  # 1536
    "rope_interleave": False,  # True
    "n_shared_experts": 2,  # 1
    "n_group": 2,  # 8
    "topk_group": 1,  # 4
    "norm_topk_prob": False,  # True
    "routed_scaling_factor": 1.5,  # 2.5
    "first_k_dense_replace": 1,  # 3
    "rms_norm_eps": 1e-5,  # 1e-6
    "max_position_embeddings": 512,  # 4096
    "tie_word_embeddings": True,  # False
    "attention_bias": True,  # False
    "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0},  # theta 10000
}

# Each defaulted field: what the engine read, and what transformers read.
FIELDS = {
    "q_lora_rank": (lambda c: c.mla.q_lora_rank, lambda h: h.q_lora_rank),
    "rope_interleave": (lambda c: c.mla.rope_interleave, lambda h: h.rope_interleave),
    "n_shared_experts": (lambda c: c.moe.num_shared_experts, lambda h: h.n_shared_experts),
    "n_group": (lambda c: c.moe.num_groups, lambda h: h.n_group),
    "topk_group": (lambda c: c.moe.topk_groups, lambda h: h.topk_group),
    "norm_topk_prob": (lambda c: c.moe.norm_topk_prob, lambda h: h.norm_topk_prob),
    "routed_scaling_factor": (
        lambda c: c.moe.routed_scaling_factor,
        lambda h: h.routed_scaling_factor,
    ),
    "first_k_dense_replace": (
        lambda c: c.moe.first_k_dense_replace,
        lambda h: h.first_k_dense_replace,
    ),
    "rms_norm_eps": (lambda c: c.rms_norm_eps, lambda h: h.rms_norm_eps),
    "max_position_embeddings": (
        lambda c: c.max_position_embeddings,
        lambda h: h.max_position_embeddings,
    ),
    "tie_word_embeddings": (lambda c: c.tie_word_embeddings, lambda h: h.tie_word_embeddings),
    "attention_bias": (lambda c: c.attention_bias, lambda h: h.attention_bias),
    "rope_parameters": (
        lambda c: (c.rope_theta, c.rope_scaling),
        lambda h: (h.rope_parameters["rope_theta"], None),  # type default: no scaling
    ),
}


def read_both(raw: dict, folder: Path):
    """The engine's ModelConfig and transformers' DeepseekV3Config of one config.json."""
    import transformers

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(raw))
    return (
        ModelConfig.from_pretrained(folder),
        transformers.DeepseekV3Config.from_pretrained(folder),
    )


@pytest.mark.parametrize("field", FIELDS)
def test_omitted_deepseek_field_is_read_as_transformers_reads_it(field, tmp_path) -> None:
    """A DeepSeek config.json that omits ``field`` is read with transformers'
    default for it (e.g. one without rope_interleave is interleaved, as DeepSeek's
    own checkpoints are); with the field present, both read the value given."""
    engine_of, hf_of = FIELDS[field]
    ours, theirs = read_both(BASE_CONFIG, tmp_path / "full")
    assert engine_of(ours) == hf_of(theirs)  # the field as given
    omitted = {k: v for k, v in BASE_CONFIG.items() if k != field}
    ours_default, theirs_default = read_both(omitted, tmp_path / "omitted")
    assert hf_of(theirs_default) != hf_of(theirs), "omitting the field must change it"
    got, want = engine_of(ours_default), hf_of(theirs_default)
    assert got == want, f"{field} omitted: the engine reads {got!r}, transformers {want!r}"


def test_deepseek_checkpoint_without_rope_interleave_matches_transformers(
    deepseek, tmp_path
) -> None:
    """The tiny interleaved DeepSeek-V3, its config.json stripped of rope_interleave
    as DeepSeek ships it: the first token's logits still equal transformers'."""
    path, model = deepseek
    assert model.config.rope_interleave  # transformers' default, and this model's
    shutil.copytree(path, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    del config["rope_interleave"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    engine = LLM(tmp_path / "m", dtype="float32").llm_engine
    prompts = random_prompts(2, seed=12, low=20, high=40)  # rotary angles well past 0
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=1))
    runner = engine.executor.model_runner
    logits = runner.forward(runner.prepare_inputs(engine.scheduler.schedule()))
    for prompt, row in zip(prompts, logits):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0, -1]
        err = (row - expected).abs().max().item()
        assert err < 1e-4, f"max |logit difference| {err:.2e}"


# --- 2. the router's weights: norm_topk_prob x routed_scaling_factor ---------------

EXPERTS, GROUPS, TOPK_GROUPS, TOP_K = 12, 4, 2, 3  # HIDDEN and INTER: test_moe.py's
COMBOS = [(norm, scale) for norm in (True, False) for scale in (1.0, 2.5)]


def make_moe(norm: bool, scale: float, seed: int = 0) -> MoE:
    """A float64 DeepSeek MoE layer with random weights and routing biases."""
    torch.manual_seed(seed)
    gate = GroupedTopKRouter(HIDDEN, EXPERTS, TOP_K, GROUPS, TOPK_GROUPS, norm, scale)
    moe = MoE(HIDDEN, INTER, 1, gate).double()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        gate.e_score_correction_bias.normal_(0, 0.1)
    return moe


def reference_routing(
    x: torch.Tensor, gate: GroupedTopKRouter, norm: bool, scale: float
) -> torch.Tensor:
    """[tokens, experts], float64, token by token: each chosen expert's weight (its
    sigmoid score, over the chosen scores' sum if norm), times scale; 0 elsewhere."""
    w, bias = gate.weight.double(), gate.e_score_correction_bias.double()
    per_group = EXPERTS // GROUPS
    out = torch.zeros(len(x), EXPERTS, dtype=torch.float64)
    for t in range(len(x)):
        s = torch.sigmoid(x[t].double() @ w.T)
        biased = (s + bias).tolist()
        group_score = [
            sum(sorted(biased[g * per_group : (g + 1) * per_group])[-2:]) for g in range(GROUPS)
        ]
        groups = sorted(range(GROUPS), key=lambda g: -group_score[g])[:TOPK_GROUPS]
        allowed = [e for g in groups for e in range(g * per_group, (g + 1) * per_group)]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:TOP_K]
        weights = s[chosen] / s[chosen].sum() if norm else s[chosen]
        out[t, chosen] = weights * scale
    return out


@pytest.mark.parametrize(("norm", "scale"), COMBOS)
def test_router_weights_match_a_float64_reference(norm: bool, scale: float) -> None:
    """Each token's expert weights are its chosen experts' scores, normalised when
    norm_topk_prob, and times routed_scaling_factor in every case, normalised or
    not (the factor must not be applied only with normalisation)."""
    gate = make_moe(norm, scale).gate
    x = torch.randn(40, HIDDEN, dtype=torch.float64)
    weights, ids = gate(x)
    got = torch.zeros(len(x), EXPERTS, dtype=torch.float64).scatter_(1, ids, weights)
    expected = reference_routing(x, gate, norm, scale)
    assert torch.equal(got != 0, expected != 0)  # the same experts chosen
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.full((40,), scale, dtype=torch.float64))


@pytest.mark.parametrize(("norm", "scale"), COMBOS)
def test_moe_layer_matches_transformers(norm: bool, scale: float) -> None:
    """The whole MoE layer (shared and routed experts) against transformers'
    DeepseekV3MoE, for every norm_topk_prob and routed_scaling_factor pair."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = hf_config(GROUPS, TOPK_GROUPS, TOP_K, EXPERTS, norm, scale)
    ours = make_moe(norm, scale, seed=1).float()
    hf = DeepseekV3MoE(cfg)
    with torch.no_grad():
        hf.gate.weight.copy_(ours.gate.weight)
        hf.gate.e_score_correction_bias.copy_(ours.gate.e_score_correction_bias)
        hf.experts.gate_up_proj.copy_(ours.experts.gate_up_proj)
        hf.experts.down_proj.copy_(ours.experts.down_proj)
        gate_w, up_w = ours.shared_experts.gate_up_proj.weight.chunk(2)
        hf.shared_experts.gate_proj.weight.copy_(gate_w)
        hf.shared_experts.up_proj.weight.copy_(up_w)
        hf.shared_experts.down_proj.weight.copy_(ours.shared_experts.down_proj.weight)
        x = torch.randn(1, 30, HIDDEN)
        expected = hf(x)[0]
        got = ours(x[0])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


# --- 3. expert parallelism on uneven batches -----------------------------------------

# World sizes, largest first: rank r takes part in every world larger than r. Three
# ranks are the fewest where a padded rank sits between two others (4 tokens: 2, 1, 1);
# a fourth rank would add a process start, seconds on two busy cores.
WORLDS = (3, 2)
EP_NORM, EP_SCALE = False, 2.5


def ep_tokens(world: int) -> list[int]:
    """Batch sizes from fewer tokens than ranks up to two rounds of every remainder."""
    return list(range(1, 2 * world + 2))


def ep_input(num_tokens: int) -> torch.Tensor:
    return torch.randn(
        num_tokens, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(num_tokens)
    )


def ep_rank(rank: int, ports: list[int], out_dir: Path, threads: int = 1) -> None:
    """One rank: for each world it belongs to, join a gloo group, place the experts
    one slot each on consecutive ranks, run every batch size, save the outputs."""
    torch.set_num_threads(threads)
    for world, port in zip(WORLDS, ports):
        if rank >= world:
            break
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=30),
        )
        try:
            moe = make_moe(EP_NORM, EP_SCALE)
            full = [moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()]
            placement = ExpertPlacement.identity(1, EXPERTS, world)
            local = placement.local_experts(rank)[0]
            moe.experts.place(local)
            with torch.no_grad():
                moe.experts.gate_up_proj.copy_(full[0][local])
                moe.experts.down_proj.copy_(full[1][local])
            moe.ep = ExpertParallel(0, placement, rank, TrafficCounters(), torch.device("cpu"))
            with torch.no_grad():
                outs = {n: moe(ep_input(n)) for n in ep_tokens(world)}
        finally:
            dist.destroy_process_group()
        torch.save(outs, out_dir / f"world{world}-rank{rank}.pt")


def ep_worker(rank: int, ports: list[int], out_dir: Path) -> None:
    """A worker process's rank; it exits at once when done (an interpreter's
    teardown takes seconds), and leaves its traceback in a file if it fails."""
    code = 0
    try:
        ep_rank(rank, ports, out_dir)
    except BaseException:
        (out_dir / f"rank{rank}.error").write_text(traceback.format_exc())
        code = 1
    os._exit(code)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_expert_parallel_output_equals_one_process_on_uneven_batches(tmp_path) -> None:
    """On 3 and 2 gloo ranks, every batch size from 1 token to 2 * ranks + 1
    (so each remainder, and ranks with no token): every rank's output equals the
    single-process layer's, row for row; the all-gather must drop the padding of
    the ranks with one token fewer, not keep it and shift the rows after it."""
    ctx = mp.get_context("spawn")
    ports = [free_port() for _ in WORLDS]
    procs = [
        ctx.Process(target=ep_worker, args=(r, ports, tmp_path), daemon=True)
        for r in range(1, max(WORLDS))
    ]
    for p in procs:
        p.start()
    try:
        ep_rank(0, ports, tmp_path, threads=torch.get_num_threads())  # rank 0: here
    finally:
        for p in procs:
            p.join(60)  # a bound on a hang, not a speed claim
            if p.is_alive():
                p.kill()
    errors = [e.read_text() for e in tmp_path.glob("*.error")]
    assert not errors, errors[0]
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    moe = make_moe(EP_NORM, EP_SCALE)  # the same seeded layer, every expert here
    with torch.no_grad():
        expected = {n: moe(ep_input(n)) for n in ep_tokens(max(WORLDS))}
    for world in WORLDS:
        for rank in range(world):
            outs = torch.load(tmp_path / f"world{world}-rank{rank}.pt")
            for n in ep_tokens(world):
                where = f"{n} tokens, {world} ranks, rank {rank}"
                torch.testing.assert_close(
                    outs[n], expected[n], rtol=1e-10, atol=1e-12, msg=lambda m, w=where: f"{w}: {m}"
                )
