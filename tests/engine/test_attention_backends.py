"""Attention backends build their own typed metadata from the step's common
metadata, and the backend, nothing else, chooses the norm and RoPE kernels."""

from __future__ import annotations

import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata, for_decodes
from engine.attention.torch_backend import TorchAttentionMetadata, TorchBackend
from tests.conftest import ROOT
from tests.engine.conftest import random_prompts


def chapter_1_example() -> AttentionMetadata:
    """Chapter 1's batch, blocks of 4: sequence a decodes its 7th token (blocks 0
    and 1), sequence b is a new 3-token prompt in block 2; then a chunk of c
    (tokens 4-6 of 7, in blocks 3 and 4)."""
    return AttentionMetadata(
        slot_mapping=torch.tensor([6, 8, 9, 10, 16, 17, 18]),
        block_tables=torch.tensor([[0, 1], [2, -1], [3, 4]], dtype=torch.int32),
        context_lens=torch.tensor([7, 3, 7], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, 1, 4, 7], dtype=torch.int32),
        num_decodes=1,
        context_lens_cpu=[7, 3, 7],
        query_lens_cpu=[1, 3, 3],
    )


def test_torch_backend_metadata() -> None:
    meta = TorchBackend(block_size=4).build_metadata(chapter_1_example())
    assert isinstance(meta, TorchAttentionMetadata)
    [group] = meta.decode_groups
    assert group.rows.tolist() == [0] and group.tables.tolist() == [[0, 1]]
    assert group.valid.flatten().tolist() == [True] * 7 + [False]
    whole, chunk = meta.prefill_chunks
    assert (whole.start, whole.num_tokens, whole.tables, whole.mask) == (1, 3, None, None)
    assert (chunk.start, chunk.num_tokens, chunk.tables.tolist()) == (4, 3, [[3, 4]])
    # Query j of the chunk sits at position 4 + j and sees positions 0 to 4 + j.
    assert chunk.mask.tolist() == [[p <= 4 + j for p in range(7)] for j in range(3)]


def test_the_backend_runs_the_norms_and_rope(qwen3, monkeypatch) -> None:
    calls = {"rms_norm": 0, "rotary_embedding": 0}
    for name in calls:
        real = getattr(TorchBackend, name)

        def spy(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(TorchBackend, name, staticmethod(spy))
    llm = LLM(qwen3[0], dtype="float32")
    llm.generate(random_prompts(1, seed=3), SamplingParams(max_tokens=2), use_tqdm=False)
    # Two steps of two layers: q, k, two layer norms each, and the final norm; RoPE once a layer.
    assert calls == {"rms_norm": 2 * (2 * 4 + 1), "rotary_embedding": 2 * 2}


def test_no_module_flips_kernels_on_the_layers() -> None:
    offenders = [p.name for p in (ROOT / "engine").rglob("*.py") if "use_triton" in p.read_text()]
    assert not offenders, offenders


def test_the_warm_up_constructor_builds_a_step_of_single_token_decodes() -> None:
    tables = torch.tensor([[0, 1], [2, -1], [3, -1]], dtype=torch.int32)
    lens = [20, 5, 1]
    meta = for_decodes(
        torch.tensor([19, 36, 48]), tables, torch.tensor(lens, dtype=torch.int32), lens
    )
    assert meta.cu_seqlens_q.tolist() == [0, 1, 2, 3]
    assert meta.num_decodes == 3 and meta.query_lens_cpu == [1, 1, 1]
    assert meta.context_lens_cpu == lens and meta.decodes_only()
    static = torch.arange(4, dtype=torch.int32)
    kept = for_decodes(meta.slot_mapping, tables, meta.context_lens, lens, static)
    assert kept.cu_seqlens_q is static  # a CUDA graph's buffer stays the one it captured
