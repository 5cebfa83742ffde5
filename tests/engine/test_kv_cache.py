"""The KV cache pool: bytes per block, how many blocks it makes, and a layer
whose cache has another format sized and allocated without the runner's help."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.kv.kv_cache import FullAttentionSpec, KVCachePool, PagedKV, store_kvcache
from engine.utils import cdiv


def test_full_attention_block_bytes_for_llama_3_8b() -> None:
    """32 layers of 8 KV heads of 128 values in bf16: 2 MiB per block of 16 tokens."""
    spec = FullAttentionSpec(num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert 32 * spec.block_bytes(16) == 2 * 16 * 32 * 8 * 128 * 2


@dataclass(frozen=True)
class LatentSpec:
    """A stand-in for a layer that caches one latent vector per token (no K/V pair)."""

    width: int

    def block_bytes(self, block_size: int) -> int:
        return block_size * self.width * 2

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> torch.Tensor:
        return torch.zeros((num_blocks, block_size, self.width), dtype=torch.float16)


class Layer:
    def __init__(self, spec) -> None:
        self.spec, self.kv_cache = spec, None

    def kv_cache_spec(self, dtype: torch.dtype):
        return self.spec


def test_the_pool_sizes_and_allocates_any_layer_format(qwen3) -> None:
    full = FullAttentionSpec(num_kv_heads=2, head_dim=8, dtype=torch.float32)
    layers = [Layer(full), Layer(LatentSpec(width=12))]
    config = EngineConfig(str(qwen3[0]), dtype="float32", num_kv_blocks=10, block_size=4)
    pool = KVCachePool(config, layers, torch.device("cpu"))
    assert pool.block_bytes() == full.block_bytes(4) + 4 * 12 * 2
    assert isinstance(layers[0].kv_cache, PagedKV)
    assert layers[0].kv_cache.k.shape == (10, 4, 2, 8)
    assert layers[1].kv_cache.shape == (10, 4, 12)
    assert pool.max_model_len == 40  # the whole cache: below the checkpoint's 512


def test_unsized_pool_fills_what_max_num_seqs_can_use(qwen3) -> None:
    llm = LLM(qwen3[0], dtype="float32", max_num_seqs=3, block_size=16)
    pool = llm.llm_engine.executor.model_runner.kv_cache
    assert pool.num_blocks == 3 * cdiv(512, 16)  # RAM is not the limit for this tiny model
    assert pool.max_model_len == 512


def test_store_kvcache_writes_each_token_at_its_slot() -> None:
    spec = FullAttentionSpec(num_kv_heads=2, head_dim=4, dtype=torch.float32)
    cache = spec.allocate(num_blocks=3, block_size=4, device=torch.device("cpu"))
    cache.k.zero_(), cache.v.zero_()  # allocate leaves zeroing to the pool (touch)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    store_kvcache(k, v, cache, torch.tensor([9, 0, 5]))
    assert torch.equal(cache.k[2, 1], k[0]) and torch.equal(cache.v[2, 1], v[0])
    assert torch.equal(cache.k[0, 0], k[1]) and torch.equal(cache.k[1, 1], k[2])
    assert cache.k.count_nonzero() == k.count_nonzero()  # nothing else written


def test_max_model_len_past_the_checkpoint_is_refused(qwen3) -> None:
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 512"):
        LLM(qwen3[0], dtype="float32", max_model_len=1000)


def test_cpu_pool_zeroes_blocks_as_they_are_first_used(qwen3) -> None:
    """On the CPU the pool is allocated, not written: blocks are zeroed (and so
    become resident) as the block manager first hands them out. Whatever the
    memory held before does not reach the outputs: here it is NaN, which a
    padded, masked read of an unzeroed block would spread (the torch backend
    pads decode groups to their longest context)."""
    prompts = [[5 + i] * (3 + 11 * i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kwargs = dict(dtype="float32", attention_backend="torch", block_size=4, num_kv_blocks=200)
    reference = LLM(qwen3[0], **kwargs)
    pool = reference.llm_engine.executor.model_runner.kv_cache
    assert pool.num_touched_blocks == 0  # nothing written at start-up
    expected = [o.token_ids for o in reference.generate(prompts, params, use_tqdm=False)]
    used = sum(cdiv(len(p) + 5, 4) for p in prompts)  # the last token is never stored
    assert pool.num_touched_blocks == used < pool.num_blocks  # only what was used

    dirty = LLM(qwen3[0], **kwargs)
    for layer in dirty.llm_engine.executor.model_runner.model.attention_layers():
        layer.kv_cache.k.fill_(float("nan")), layer.kv_cache.v.fill_(float("nan"))
    assert [o.token_ids for o in dirty.generate(prompts, params, use_tqdm=False)] == expected
