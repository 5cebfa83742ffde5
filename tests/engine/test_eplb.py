"""EPLB's policy on random loads, and placements applied in one process: the
placement changes where tokens run, never what the model outputs."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.distributed.eplb import balanced_packing, imbalance, rebalance_experts
from engine.distributed.placement import ExpertPlacement, replica_slots
from tests.conftest import ROOT

TINY_MOE = ROOT / "snippets" / "models" / "deepinfer-tiny-moe"

# (experts, groups, replicas, nodes, gpus): hierarchical cases, then ones whose
# nodes do not divide the groups (the global policy).
SHAPES = [
    (16, 4, 16, 1, 2),
    (16, 4, 20, 2, 4),
    (16, 4, 24, 4, 8),
    (64, 8, 80, 2, 8),
    (256, 8, 288, 4, 32),
    (16, 4, 18, 3, 3),
    (12, 3, 16, 2, 4),
]


def random_load(layers: int, experts: int, seed: int) -> torch.Tensor:
    """Skewed like a router's: a few hot experts, many cold ones, some unused."""
    g = torch.Generator().manual_seed(seed)
    load = torch.distributions.Exponential(1.0).sample((layers, experts)) ** 3
    load = (load * 1000 * torch.rand(layers, experts, generator=g)).round()
    load[:, torch.randint(experts, (1,), generator=g)] = 0.0
    return load


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("seed", range(3))
def test_rebalance_experts_properties(shape, seed) -> None:
    experts, groups, replicas, nodes, gpus = shape
    torch.manual_seed(seed)
    load = random_load(3, experts, seed)
    phy2log, log2phy, logcnt = rebalance_experts(load, replicas, groups, nodes, gpus)
    assert phy2log.shape == (3, replicas)
    assert (logcnt >= 1).all()  # every logical expert has a replica
    assert (logcnt.sum(1) == replicas).all()
    per_gpu = replicas // gpus  # GPU g holds slots [g * per_gpu, (g + 1) * per_gpu)
    for layer in range(3):
        for e in range(experts):  # the three maps agree with each other
            slots = log2phy[layer, e, : logcnt[layer, e]]
            assert (phy2log[layer, slots] == e).all()
            assert (log2phy[layer, e, logcnt[layer, e] :] == -1).all()
        if groups % nodes == 0:  # hierarchical: a group's slots sit on one node
            node_of_slot = torch.arange(replicas) // (replicas // nodes)
            group_of_slot = phy2log[layer] // (experts // groups)
            for g in range(groups):
                assert len(set(node_of_slot[group_of_slot == g].tolist())) == 1
    assert per_gpu * gpus == replicas
    if experts % gpus == 0:  # the packing itself fills every GPU equally
        packs = balanced_packing(load[0].tolist(), gpus)
        assert [packs.count(g) for g in range(gpus)] == [experts // gpus] * gpus


def test_balanced_packing_fills_every_pack_equally() -> None:
    loads = [9.0, 1.0, 8.0, 2.0, 7.0, 3.0, 6.0, 4.0]
    packs = balanced_packing(loads, 4)
    assert sorted(packs) == [0, 0, 1, 1, 2, 2, 3, 3]
    sums = [sum(w for w, p in zip(loads, packs) if p == k) for k in range(4)]
    assert sums == [10.0] * 4  # heaviest first into the lightest: 9+1, 8+2, 7+3, 6+4


def test_the_heaviest_experts_get_the_copies() -> None:
    """Expert 5 carries as much as all the others together, expert 9 half that: the
    spare slots go where a replica's share is largest, and the GPUs come out even."""
    load = torch.ones(1, 16)
    load[0, 5], load[0, 9] = 15.0, 7.5
    phy2log, _, logcnt = rebalance_experts(load, 20, 4, 1, 4)
    # 4 spare slots: to 5 (15 -> 7.5 a copy), 5 again (tied with 9, lower id), 9, 5:
    # four copies of 3.75, two of 3.75, and every other expert's 1.
    assert logcnt[0, 5] == 4 and logcnt[0, 9] == 2
    assert imbalance(load, phy2log, 4)[0] < imbalance(load, torch.arange(16)[None], 4)[0]
    per_gpu = [sorted(phy2log[0, g * 5 : (g + 1) * 5].tolist()) for g in range(4)]
    assert all(5 in slots for slots in per_gpu)  # a copy on every GPU


def test_bad_shapes_are_refused() -> None:
    load = torch.ones(1, 16)
    with pytest.raises(ValueError, match="multiple of num_gpus"):
        rebalance_experts(load, 18, 4, 1, 4)
    with pytest.raises(ValueError, match="every expert needs a slot"):
        rebalance_experts(load, 8, 4, 1, 2)


def test_replicas_take_an_experts_tokens_in_turn() -> None:
    """Expert 0 has slots 0 and 2: its tokens alternate between them, across calls."""
    placement = ExpertPlacement(torch.tensor([[0, 1, 0, 2]]), 2, 3)
    turns = torch.zeros(3, dtype=torch.int64)
    ids = torch.tensor([[0, 1], [0, 2], [1, 0]])
    first = replica_slots(ids, turns, placement.log2phy[0], placement.logcnt[0])
    assert first.tolist() == [[0, 1], [2, 3], [1, 0]]
    second = replica_slots(ids[:1], turns, placement.log2phy[0], placement.logcnt[0])
    assert second.tolist() == [[2, 1]]  # expert 0's fourth token: its second replica


PROMPTS = ["def schedule(self):", "The expert", "import torch\n", "class MoE(nn.Module):"]


@pytest.fixture(scope="module")
def tiny_moe_reference() -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens of deepinfer-tiny-moe with every expert in place, and its load."""
    llm = LLM(TINY_MOE, dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=24)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    return tokens, llm.stats.expert_tokens.clone()


@pytest.mark.parametrize("gpus", [2, 4, 8])
@pytest.mark.parametrize("redundant", [0, 8, 16])
def test_eplb_never_worse_than_identity_on_tiny_moe_load(
    tiny_moe_reference, gpus, redundant
) -> None:
    _, load = tiny_moe_reference
    load = load[load.sum(1) > 0]  # the MTP module's layer runs no tokens here
    experts = load.shape[1]
    identity = torch.arange(experts).repeat(len(load), 1)
    phy2log, _, _ = rebalance_experts(load, experts + redundant, 4, 1, gpus)
    before, after = imbalance(load, identity, gpus), imbalance(load, phy2log, gpus)
    assert all(a <= b + 1e-9 for a, b in zip(after, before)), (before, after)
    if redundant:
        assert max(after) < max(before)


def test_output_is_unchanged_by_a_redundant_placement(tiny_moe_reference) -> None:
    """One process, 4 extra slots: EPLB's placement from the start, then a
    re-balance between steps; the greedy tokens stay those of no placement."""
    tokens, _ = tiny_moe_reference
    llm = LLM(TINY_MOE, dtype="float32", num_redundant_experts=4)
    assert llm.llm_engine.eplb.placement.phy2log.shape[1] == 20
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=24)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    done = {}
    while engine.has_unfinished_requests():
        if llm.stats.steps == 5:
            report = llm.rebalance_experts(num_redundant=6)  # mid-generation
            assert engine.eplb.placement.phy2log.shape[1] == 22
            assert len(report.imbalance_before) == len(report.imbalance_after)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[str(i)] for i in range(len(PROMPTS))] == tokens
    engine.eplb.sync_stats()
    slots = llm.stats.expert_slot_tokens
    assert slots is not None and slots.shape == (4, 22) and slots.sum() > 0


def test_eplb_on_a_clock_keeps_the_output(tiny_moe_reference) -> None:
    """enable_eplb re-places the experts every eplb_interval steps, mid-generation."""
    tokens, _ = tiny_moe_reference
    llm = LLM(TINY_MOE, dtype="float32", enable_eplb=True, eplb_interval=4, num_redundant_experts=4)
    params = SamplingParams(temperature=0, max_tokens=24)
    assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == tokens
    assert len(llm.llm_engine.eplb.reports) == llm.stats.steps // 4 > 0
