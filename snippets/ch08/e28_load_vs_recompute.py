"""Experiment 28: load a prefix's KV cache from a tier, or compute it again.

A request's prefix of L tokens is cached somewhere outside this GPU. Loading
it costs a fixed latency, then L times the KV bytes per token over the
tier's bandwidth. Computing it again is a prefill of L tokens: every layer
must run, since each layer's keys and values come from the layer below, so it
costs 2 FLOPs per weight a token multiplies by, times L, plus attention, whose
query i reads i keys, which grows with the square of L. No logits are needed,
so the embedding lookup and the output head are left out of the weights.

Configs are the models' config.json (as in Experiment 3). KV bytes per token
re-derive Experiment 3's formulas: a key and a value per KV head per layer for
GQA; one latent plus one RoPE key per layer for MLA. DeepSeek-V3's prefill
attention is taken in MHA form, each of 128 heads with a 192-wide query-key
and a 128-wide value (fewer FLOPs per key than over the latent); its MLP
counts the experts a token is routed to (8) and the shared one. The GPU rate is a published peak at an assumed
utilization. Bandwidths are published figures; latencies are assumed.

For each model and tier the table gives the shortest prefix for which
loading is faster (the break-even), and load time over recompute time at two
lengths. Below "pays above" GB/s, loading is slower per token than the
weights' share of recompute, and pays only once attention has grown.
"""

from __future__ import annotations

BYTES = 2  # bf16
GB = 10**9
H100_SPARSE_TFLOPS = 1979  # bf16 Tensor Core, with sparsity (NVIDIA datasheet)
DENSE_TFLOPS = H100_SPARSE_TFLOPS / 2  # the datasheet: half without sparsity
UTILIZATION = 0.5  # assumed share of the peak a prefill reaches
LENGTHS = [4096, 32768]  # prefix lengths for the load/recompute ratio
US = 1e-6

LLAMA = dict(
    name="Llama-3.1-8B",
    num_hidden_layers=32,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
)
DEEPSEEK = dict(
    name="DeepSeek-V3",
    num_hidden_layers=61,
    first_k_dense_replace=3,  # layers 0-2 have a dense MLP, the rest MoE
    hidden_size=7168,
    intermediate_size=18432,  # the dense MLP
    moe_intermediate_size=2048,  # each expert
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_routed_experts=256,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    max_position_embeddings=163840,
)

# Published figures the tiers are built from.
PCIE_BOTH_WAYS = 128 * GB  # PCIe Gen5 x16, both directions together (NVIDIA datasheet)
PM1743_READ = 13_000 * 10**6  # Samsung PM1743 sequential read, 13,000 MB/s
NIC_GBIT = 400  # a CX7 InfiniBand NIC per H800 (DeepEP); a 3FS client node's NIC (3FS)
GPUS_PER_NODE = 8  # H800s per node (DeepSeek's inference overview)
ETHERNET_GBIT = 25  # an ordinary data-center Ethernet link (an assumed tier)
BITS = 8
# name, bandwidth in bytes/s, latency in s (every latency is assumed)
TIERS = [
    ("peer GPU, RDMA", NIC_GBIT * GB / BITS, 10 * US),
    ("host, PCIe Gen5", PCIE_BOTH_WAYS / 2, 10 * US),
    ("local NVMe SSD", PM1743_READ, 100 * US),
    # the client node's NIC, shared by its GPUs when all of them load at once
    ("3FS, a GPU's share", NIC_GBIT * GB / BITS / GPUS_PER_NODE, 1000 * US),
    ("cache server, TCP", ETHERNET_GBIT * GB / BITS, 1000 * US),
]
SLUGS = ["rdma", "pcie", "nvme", "threefs", "tcp"]


def kv_bytes(cfg: dict) -> int:
    """Experiment 3's formulas: GQA keeps K and V per KV head; MLA keeps
    one latent and one RoPE key, shared by every head."""
    if "kv_lora_rank" in cfg:
        per_layer = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    else:
        per_layer = 2 * cfg["num_key_value_heads"] * cfg["head_dim"]
    return cfg["num_hidden_layers"] * per_layer * BYTES


def llama_weights(cfg: dict) -> int:
    """Weights one token multiplies by, over every layer."""
    h, kv = cfg["hidden_size"], cfg["num_key_value_heads"] * cfg["head_dim"]
    attention = 2 * h * h + 2 * h * kv  # q and o; k and v
    mlp = 3 * h * cfg["intermediate_size"]  # gate, up, down
    return cfg["num_hidden_layers"] * (attention + mlp)


def deepseek_weights(cfg: dict) -> int:
    """MLA's projections in every layer; a dense MLP in the first layers,
    the routed and shared experts (and the router) in the others."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    latent = cfg["kv_lora_rank"]
    attention = (
        h * cfg["q_lora_rank"]  # q down
        + cfg["q_lora_rank"] * heads * qk  # q up
        + h * (latent + cfg["qk_rope_head_dim"])  # kv down, rope key
        + latent * heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"])  # kv up
        + heads * cfg["v_head_dim"] * h  # o
    )
    dense, layers = cfg["first_k_dense_replace"], cfg["num_hidden_layers"]
    experts = cfg["num_experts_per_tok"] + cfg["n_shared_experts"]
    moe = experts * 3 * h * cfg["moe_intermediate_size"] + h * cfg["n_routed_experts"]
    return layers * attention + dense * 3 * h * cfg["intermediate_size"] + (layers - dense) * moe


def attention_width(cfg: dict) -> int:
    """Per layer, the query-key plus value width over all query heads."""
    if "kv_lora_rank" in cfg:
        qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
        return cfg["num_attention_heads"] * (qk + cfg["v_head_dim"])
    return cfg["num_attention_heads"] * 2 * cfg["head_dim"]


def recompute_s(model: dict, length: int) -> float:
    """2 FLOPs a weight a token, plus attention: query i reads i keys,
    a multiply-add over the query-key and the value width for each."""
    linear = 2 * model["weights"] * length
    attention = model["layers"] * model["width"] * length * (length + 1)
    return (linear + attention) / flop_rate()


def flop_rate() -> float:
    """FLOPs a second: the datasheet's dense peak at the assumed utilization."""
    return DENSE_TFLOPS * 1e12 * UTILIZATION


def load_s(model: dict, tier: tuple, length: int) -> float:
    _, bandwidth, latency = tier
    return latency + length * model["kv"] / bandwidth


def break_even(model: dict, tier: tuple) -> int | None:
    """The shortest prefix that loads faster than it computes, within the
    model's context; None if none does. Load minus recompute is concave in
    the length and positive at zero, so it changes sign at most once."""
    lo, hi = 1, model["context"]
    if load_s(model, tier, hi) >= recompute_s(model, hi):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if load_s(model, tier, mid) < recompute_s(model, mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def describe(cfg: dict, weights: int) -> dict:
    return {
        "name": cfg["name"],
        "kv": kv_bytes(cfg),
        "weights": weights,
        "layers": cfg["num_hidden_layers"],
        "width": attention_width(cfg),
        "context": cfg["max_position_embeddings"],
    }


def model_lines(m: dict) -> dict:
    """Print a model's header; return its per-token figures."""
    per_token = 2 * m["weights"] / flop_rate()  # the weights' share
    pays_above = m["kv"] / per_token
    equal_at = 2 * m["weights"] / (m["layers"] * m["width"])
    print(f"{m['name']}: {m['kv']:,} KV bytes a token")
    print(f"  weights a token multiplies: {m['weights'] / GB:.2f} billion")
    print(f"  recompute: {per_token / US:.1f} us a token, plus attention,")
    print("  whose total over a whole prefix equals the")
    print(f"  weights' total at a prefix of {equal_at:,.0f} tokens")
    print(f"  loading pays per token above {pays_above / GB:.2f} GB/s")
    return {"us_per_token": per_token / US, "pays_above": pays_above / GB, "equal_at": equal_at}


def tier_table(m: dict, slug: str) -> dict:
    """Print each tier's break-even and ratios for one model."""
    heads = "".join(f"{n // 1024}k".rjust(7) for n in LENGTHS)
    print(f"{'tier':<19}{'GB/s':>5}{'lat us':>7}{'even at':>8}{heads}")
    results: dict = {}
    for tier, tslug in zip(TIERS, SLUGS):
        name, bandwidth, latency = tier
        even = break_even(m, tier)
        ratios = [load_s(m, tier, n) / recompute_s(m, n) for n in LENGTHS]
        cell = f"{even:,}" if even is not None else "never"
        cells = "".join(f"{r:>7.1%}" for r in ratios)
        print(f"{name:<19}{bandwidth / GB:>5.3g}{latency / US:>7.0f}{cell:>8}{cells}")
        results[f"{slug}_{tslug}_break_even"] = even if even is not None else "never"
        for n, r in zip(LENGTHS, ratios):
            results[f"{slug}_{tslug}_ratio_{n // 1024}k"] = round(r, 3)
    return results


def main() -> dict:
    models = [
        describe(LLAMA, llama_weights(LLAMA)),
        describe(DEEPSEEK, deepseek_weights(DEEPSEEK)),
    ]
    print(f"recompute at {DENSE_TFLOPS} TFLOPS (H100 SXM, bf16 dense)")
    print(f"  at {UTILIZATION:.0%} utilization (assumed)")
    print("columns: load time over recompute time, for")
    print("  prefixes of " + " and ".join(f"{n:,}" for n in LENGTHS) + " tokens")
    results: dict = {"dense_tflops": DENSE_TFLOPS, "utilization": UTILIZATION}
    results["short"], results["long"] = LENGTHS
    results |= {"sparse_tflops": H100_SPARSE_TFLOPS, "pcie_both_gb": PCIE_BOTH_WAYS // GB}
    results |= {"nvme_mb": PM1743_READ // 10**6, "nic_gbit": NIC_GBIT}
    results |= {"gpus_per_node": GPUS_PER_NODE, "ethernet_gbit": ETHERNET_GBIT}
    for name, bandwidth, latency in TIERS:
        tslug = SLUGS[[t[0] for t in TIERS].index(name)]
        results[f"{tslug}_gb"] = round(bandwidth / GB, 2)
        results[f"{tslug}_latency_us"] = round(latency / US)
    for m, slug in zip(models, ["llama", "deepseek"]):
        print()
        figures = model_lines(m)
        results[f"{slug}_kv_bytes"] = m["kv"]
        results[f"{slug}_weights_b"] = round(m["weights"] / GB, 2)
        results[f"{slug}_us_per_token"] = round(figures["us_per_token"], 1)
        results[f"{slug}_pays_above_gb"] = round(figures["pays_above"], 2)
        results[f"{slug}_attention_equal_at"] = round(figures["equal_at"])
        results |= tier_table(m, slug)
    return results


if __name__ == "__main__":
    main()
