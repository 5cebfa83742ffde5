"""Demo: DeepSeek-V3.2's lightning indexer chooses the tokens MLA reads.

No trained V3.2 model is small enough to ship, so the demo builds one with
random weights: transformers' DeepseekV32ForCausalLM at a toy size, seeded,
saved to a temporary folder with deepinfer-tiny-moe's tokenizer. The engine
serves it as it would a real checkpoint. Each query keeps its TOPK best cached
tokens by the indexer's score, and attention reads only those.

A forward hook on the first layer's indexer records the positions each query
kept. The demo prints them for the first decode steps, counts how many of the
kept tokens are among the most recent TOPK, then runs the same weights with a
top-k wider than any context (dense MLA) and says where the two replies part.
The weights are random, so which tokens win means nothing about language: the
point is the mechanism, and that sparsity changes what the model computes.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch

from engine import LLM, SamplingParams

TOKENIZER = Path(os.environ.get("DEEPINFER_DEMO_MODEL_MOE", "snippets/models/deepinfer-tiny-moe"))
TOPK = 8
PROMPT = list(range(100, 148))  # 48 token ids
STEPS = 4  # decode steps whose choices are printed
REPLY = 24
LAYER = 0  # the layer whose indexer is watched


def build(folder: Path, topk: int) -> Path:
    """A random DeepseekV32ForCausalLM checkpoint whose indexer keeps ``topk`` tokens."""
    import transformers

    config = transformers.DeepseekV32Config(
        vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512,
        initializer_range=0.1, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=24, moe_intermediate_size=32, n_routed_experts=8,
        n_group=4, topk_group=2, num_experts_per_tok=3, first_k_dense_replace=1,
        index_topk=topk, index_n_heads=16, index_head_dim=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.DeepseekV32ForCausalLM(config).eval()
    with torch.no_grad():  # transformers starts the key norm at ones and zeros
        for layer in model.model.layers:
            layer.self_attn.indexer.k_norm.weight.normal_(1, 0.1)
            layer.self_attn.indexer.k_norm.bias.normal_(0, 0.1)
    path = folder / f"dsa-top{topk}"
    model.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / name, path / name)
    return path


def run(path: Path) -> tuple[list[int], list[list[int]]]:
    """The greedy reply, and the positions LAYER's indexer kept for each decode."""
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32, block_size=8)
    indexer = llm.llm_engine.executor.model_runner.model.model.layers[LAYER].self_attn.indexer
    kept: list[list[int]] = []

    def record(_module, _inputs, chosen: torch.Tensor) -> None:
        if len(chosen) == 1:  # a decode step: one query
            kept.append(sorted(p for p in chosen[0].tolist() if p >= 0))

    indexer.register_forward_hook(record)
    params = SamplingParams(temperature=0, max_tokens=REPLY, ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    return out.token_ids, kept


def main() -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        sparse, kept = run(build(Path(tmp), TOPK))
        dense, _ = run(build(Path(tmp), 4 * len(PROMPT)))
    print(f"prompt of {len(PROMPT)} tokens, a reply of {REPLY}; each query keeps {TOPK}")
    print(f"{'query at':>8}  positions kept by layer {LAYER}, from zero")
    for step, positions in enumerate(kept[:STEPS]):
        print(f"{len(PROMPT) + step:>8}  {' '.join(map(str, positions))}")
    # Query i sits at position len(PROMPT) + i; the newest TOPK end there.
    recent = [sum(1 for p in row if p > len(PROMPT) + i - TOPK) for i, row in enumerate(kept)]
    print(f"kept among the newest {TOPK}, mean: {sum(recent) / len(recent):.2f}")
    first = next((i for i, (a, b) in enumerate(zip(sparse, dense)) if a != b), len(sparse))
    print(f"reply tokens before sparse and dense part: {first}")
    return {
        "prompt_len": len(PROMPT),
        "reply": REPLY,
        "topk": TOPK,
        "first_kept": kept[0],
        "recent_mean": round(sum(recent) / len(recent), 2),
        "decodes": len(kept),
        "first_differs": first,
    }


if __name__ == "__main__":
    main()
