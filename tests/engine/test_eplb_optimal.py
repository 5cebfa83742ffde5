"""EPLB's policy against brute-force optima on small cases, and its invariants on
random loads (hypothesis).

test_eplb.py checks the policy's maps for shape and consistency on fixed shapes.
This file checks what the greedy policy *guarantees* about balance:

- replication (one slot each, then each spare slot to the expert whose replicas
  carry the most each) minimises the largest replica share: it is optimal, so it
  must equal a brute force over every replica-count vector;
- packing the replicas onto a node's GPUs, heaviest share first into the lightest
  GPU with a free slot, is optimal when each GPU has one or two slots (with two,
  it pairs the i-th heaviest with the i-th lightest, which is optimal by an
  exchange argument), so its busiest GPU must equal a brute force over every
  packing of the same replicas;
- with three slots a GPU this is the "modified LPT" of 3-partitioning, whose
  busiest GPU is within 4/3 - 1/(3m) of optimal on m GPUs (Kellerer and
  Woeginger, "A tight bound for 3-partitioning", Discrete Appl. Math. 45, 1993).

A GPU's load is the sum of its replicas' shares, a replica carrying load / count
of its expert's tokens (replicas take an expert's tokens in turn).
"""

from __future__ import annotations

import itertools
from fractions import Fraction

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.distributed.eplb import balanced_packing, imbalance, rebalance_experts

REL = 1e-9  # float64 shares against exact fractions


def best_packing(shares: list[Fraction], num_bins: int) -> Fraction:
    """The smallest possible busiest bin over every way to put len / num_bins of the
    shares into each bin (bins are interchangeable: the first free share opens one)."""
    per_bin = len(shares) // num_bins

    def best(rest: tuple[Fraction, ...]) -> Fraction:
        if not rest:
            return Fraction(0)
        first, others = rest[0], rest[1:]
        out = None
        for mates in itertools.combinations(range(len(others)), per_bin - 1):
            load = first + sum((others[i] for i in mates), Fraction(0))
            left = tuple(s for i, s in enumerate(others) if i not in mates)
            worst = max(load, best(left))
            out = worst if out is None else min(out, worst)
        return out

    return best(tuple(sorted(shares, reverse=True)))


def best_counts(loads: list[int], num_slots: int) -> Fraction:
    """The smallest possible largest replica share over every replica-count vector
    (each expert at least one replica, num_slots replicas in all)."""
    best = None
    for cut in itertools.combinations(range(1, num_slots), len(loads) - 1):
        counts = [b - a for a, b in zip((0, *cut), (*cut, num_slots))]
        worst = max(Fraction(w, c) for w, c in zip(loads, counts))
        best = worst if best is None else min(best, worst)
    return best


def gpu_loads(loads: list[int], phy2log: list[int], num_gpus: int) -> list[Fraction]:
    """Each GPU's tokens, exactly: its replicas' shares of their experts' loads."""
    counts = [phy2log.count(e) for e in range(len(loads))]
    per_gpu = len(phy2log) // num_gpus
    return [
        sum((Fraction(loads[e], counts[e]) for e in phy2log[g * per_gpu : (g + 1) * per_gpu]), 0)
        for g in range(num_gpus)
    ]


@st.composite
def cases(draw, max_gpus_per_node: int, slots_per_gpu: tuple[int, ...]):
    """(loads, replicas, groups, nodes, gpus) for EPLB's hierarchical policy (groups
    packed whole onto nodes) or, with one node, its global one; at least two GPUs a
    node and at least one spare slot a node, so that some expert is replicated."""
    nodes = draw(st.sampled_from([1, 2]))
    gpus_per_node = draw(st.integers(2, max_gpus_per_node))
    slots_per_node = gpus_per_node * draw(st.sampled_from(slots_per_gpu))
    experts_per_node = draw(st.integers(1, slots_per_node - 1))
    divisors = [d for d in range(1, experts_per_node + 1) if experts_per_node % d == 0]
    groups = nodes * draw(st.sampled_from(divisors))
    experts = nodes * experts_per_node
    # Token counts, skewed as a router's: some unused experts, a hot one or two.
    loads = draw(
        st.lists(
            st.one_of(st.integers(0, 30), st.integers(0, 3000)),
            min_size=experts,
            max_size=experts,
        )
    )
    return loads, nodes * slots_per_node, groups, nodes, nodes * gpus_per_node


def place(loads: list[int], replicas: int, groups: int, nodes: int, gpus: int) -> list[int]:
    phy2log, _, _ = rebalance_experts(
        torch.tensor([loads], dtype=torch.float64), replicas, groups, nodes, gpus
    )
    return phy2log[0].tolist()


def nodes_of(phy2log: list[int], loads: list[int], nodes: int, gpus: int):
    """Per node: its replicas' exact shares, and its GPUs' exact loads."""
    counts = [phy2log.count(e) for e in range(len(loads))]
    per_node = len(phy2log) // nodes
    per_gpu_loads = gpu_loads(loads, phy2log, gpus)
    gpus_per_node = gpus // nodes
    for n in range(nodes):
        slots = phy2log[n * per_node : (n + 1) * per_node]
        shares = [Fraction(loads[e], counts[e]) for e in slots]
        yield shares, per_gpu_loads[n * gpus_per_node : (n + 1) * gpus_per_node]


def assert_close_fraction(got: Fraction, want: Fraction, what: str) -> None:
    assert abs(got - want) <= REL * max(1, want), f"{what}: {float(got)} != {float(want)}"


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cases(max_gpus_per_node=4, slots_per_gpu=(1, 2)))
def test_packing_with_up_to_two_slots_a_gpu_is_optimal(case) -> None:
    """With one or two slots a GPU, each node's busiest GPU carries exactly the
    optimum of packing that node's replicas (brute force): the policy packs
    replicas by their share of the expert's load, not by the expert's whole load."""
    loads, replicas, groups, nodes, gpus = case
    phy2log = place(loads, replicas, groups, nodes, gpus)
    for shares, per_gpu in nodes_of(phy2log, loads, nodes, gpus):
        assert_close_fraction(max(per_gpu), best_packing(shares, len(per_gpu)), "busiest GPU")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(cases(max_gpus_per_node=3, slots_per_gpu=(3,)))
def test_packing_with_three_slots_a_gpu_is_within_the_3_partitioning_bound(case) -> None:
    """With three slots a GPU, each node's busiest GPU is within Kellerer and
    Woeginger's tight bound for modified LPT, 4/3 - 1/(3m) times the optimum."""
    loads, replicas, groups, nodes, gpus = case
    phy2log = place(loads, replicas, groups, nodes, gpus)
    for shares, per_gpu in nodes_of(phy2log, loads, nodes, gpus):
        m = len(per_gpu)
        bound = (Fraction(4, 3) - Fraction(1, 3 * m)) * best_packing(shares, m)
        assert max(per_gpu) <= bound * (1 + REL), (float(max(per_gpu)), float(bound))


def test_a_hot_expert_s_replicas_are_packed_by_their_share() -> None:
    """Loads 12, 7, 5, 2, 1 on three GPUs of two slots: the spare slot halves expert 0
    into two replicas of 6, and the shares 7, 6, 6, 5, 2, 1 pack at best as
    {7, 1}, {6, 2}, {6, 5}: 11 on the busiest GPU. Packing by the whole load (12 for
    each copy of expert 0) spreads the copies first and puts 7 with 5: 12."""
    loads = [12, 7, 5, 2, 1]
    phy2log = place(loads, 6, 1, 1, 3)
    assert [phy2log.count(e) for e in range(len(loads))] == [2, 1, 1, 1, 1]
    shares = [Fraction(s) for s in (6, 6, 7, 5, 2, 1)]
    assert best_packing(shares, 3) == 11
    assert max(gpu_loads(loads, phy2log, 3)) == 11


@settings(max_examples=60, deadline=None, derandomize=True)
@given(cases(max_gpus_per_node=3, slots_per_gpu=(1, 2, 3)))
def test_replica_counts_minimise_the_largest_share(case) -> None:
    """Within each node, the replica counts make the largest replica share as
    small as any count vector can (brute force), and a heavier expert never has
    fewer replicas than a lighter one on the same node."""
    loads, replicas, groups, nodes, gpus = case
    phy2log = place(loads, replicas, groups, nodes, gpus)
    counts = [phy2log.count(e) for e in range(len(loads))]
    per_node = replicas // nodes
    for n in range(nodes):
        experts = sorted(set(phy2log[n * per_node : (n + 1) * per_node]))
        largest = max(Fraction(loads[e], counts[e]) for e in experts)
        assert largest == best_counts([loads[e] for e in experts], per_node)
        for a, b in itertools.permutations(experts, 2):
            if loads[a] > loads[b]:
                assert counts[a] >= counts[b], (a, b, loads, counts)


@st.composite
def any_shape(draw):
    """Any shape EPLB accepts, including nodes that do not divide the groups (the
    global policy), with several layers of random loads."""
    group_size = draw(st.integers(1, 4))
    groups = draw(st.integers(1, 4))
    experts = groups * group_size
    gpus = draw(st.integers(1, 6))
    nodes = draw(st.sampled_from([n for n in range(1, gpus + 1) if gpus % n == 0]))
    per_gpu = draw(st.integers(-(-experts // gpus), -(-experts // gpus) + 3))
    replicas = gpus * per_gpu
    layers = draw(st.integers(1, 3))
    flat = draw(
        st.lists(st.integers(0, 5000), min_size=layers * experts, max_size=layers * experts)
    )
    load = torch.tensor(flat, dtype=torch.float64).view(layers, experts)
    return load, replicas, groups, nodes, gpus


@settings(max_examples=60, deadline=None, derandomize=True)
@given(any_shape())
def test_policy_invariants_on_random_loads(shape) -> None:
    """On random loads and shapes: every expert has a replica and the counts fill
    the slots; each node holds the same number of slots and whole groups (when it
    can); imbalance() is the busiest GPU over the mean GPU with each replica
    carrying its share; and the busiest GPU is never below the two lower bounds
    of any placement, the mean GPU and the largest replica share."""
    load, replicas, groups, nodes, gpus = shape
    experts = load.shape[1]
    phy2log, log2phy, logcnt = rebalance_experts(load, replicas, groups, nodes, gpus)
    assert phy2log.shape == (len(load), replicas) and phy2log.dtype == torch.int64
    assert ((phy2log >= 0) & (phy2log < experts)).all()
    assert (logcnt >= 1).all() and (logcnt.sum(1) == replicas).all()
    hierarchical = groups % nodes == 0
    per_node, group_size = replicas // nodes, experts // groups
    for layer, row in enumerate(phy2log.tolist()):
        assert logcnt[layer].tolist() == [row.count(e) for e in range(experts)]
        if hierarchical:  # every group's replicas on one node, each node full
            node_groups = [
                {e // group_size for e in row[n * per_node : (n + 1) * per_node]}
                for n in range(nodes)
            ]
            assert sum(len(g) for g in node_groups) == groups
            assert all(len(g) == groups // nodes for g in node_groups)
        loads = load[layer].long().tolist()
        per_gpu = gpu_loads(loads, row, gpus)
        total = sum(per_gpu)
        assert total == sum(loads)  # replicas share their expert's load: none lost
        busiest = max(per_gpu)
        largest_share = max(Fraction(w, row.count(e)) for e, w in enumerate(loads))
        assert busiest >= total / gpus and busiest >= largest_share
        want = float(busiest / (total / gpus)) if total else 1.0
        got = imbalance(load[layer : layer + 1], phy2log[layer : layer + 1], gpus)[0]
        assert abs(got - want) <= 1e-9 * want


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.integers(1, 4).flatmap(
        lambda packs: st.tuples(
            st.just(packs),
            st.integers(1, 3).flatmap(
                lambda per_pack: st.lists(
                    st.integers(0, 1000), min_size=packs * per_pack, max_size=packs * per_pack
                )
            ),
        )
    )
)
def test_balanced_packing_fills_each_pack_and_meets_its_bound(case) -> None:
    """balanced_packing alone, on random loads: each pack gets exactly its share of
    the items, and the heaviest pack is optimal (brute force) with up to two items
    a pack, within 4/3 - 1/(3m) of optimal with three."""
    packs, loads = case
    per_pack = len(loads) // packs
    where = balanced_packing([float(w) for w in loads], packs)
    assert sorted(where) == [p for p in range(packs) for _ in range(per_pack)]
    heaviest = max(sum(w for w, p in zip(loads, where) if p == k) for k in range(packs))
    optimum = best_packing([Fraction(w) for w in loads], packs)
    if per_pack <= 2:
        assert heaviest == optimum
    else:
        assert heaviest <= (Fraction(4, 3) - Fraction(1, 3 * packs)) * optimum
