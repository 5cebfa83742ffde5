"""The KV cache pool: bytes per block, how many blocks it makes, a layer whose
cache has another format sized and allocated without the runner's help, and
blocks copied out of one pool and into another."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from engine.attention.metadata import AttentionMetadata
from engine.config import EngineConfig
from engine.kv.kv_cache import (
    FullAttentionSpec,
    KVBlocks,
    KVCachePool,
    LatentKV,
    PagedKV,
    store_kvcache,
)
from engine.utils import cdiv
from tests.engine.conftest import build_checkpoint, random_prompts
from tests.engine.test_mtp import run


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

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> LatentKV:
        return LatentKV(torch.zeros((num_blocks, block_size, self.width), dtype=torch.float16))


@dataclass
class QuantizedKV:
    """A stand-in for a format the pool has never heard of: int8 values and a scale
    per token, three tensors in all, each with the block first."""

    k: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.k, self.v, self.scales]


@dataclass(frozen=True)
class QuantizedSpec:
    width: int

    def block_bytes(self, block_size: int) -> int:
        return block_size * (2 * self.width + 4)

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> QuantizedKV:
        def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((num_blocks, block_size, *shape), 7, dtype=dtype)  # not zero

        return QuantizedKV(
            empty(self.width, dtype=torch.int8),
            empty(self.width, dtype=torch.int8),
            empty(dtype=torch.float32),
        )


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
    assert layers[1].kv_cache.rows.shape == (10, 4, 12)
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


def small_pool(qwen3, specs: list, num_blocks: int = 10, block_size: int = 4) -> KVCachePool:
    config = EngineConfig(
        str(qwen3[0]), dtype="float32", num_kv_blocks=num_blocks, block_size=block_size
    )
    return KVCachePool(config, [Layer(spec) for spec in specs], torch.device("cpu"))


def test_touch_zeroes_every_tensor_of_any_cache_format(qwen3) -> None:
    pool = small_pool(qwen3, [QuantizedSpec(width=3), LatentSpec(width=5)])
    pool.touch(2)
    for layer in pool.layers:
        for t in layer.kv_cache.tensors():
            assert t[:2].count_nonzero() == 0  # zeroed, through KVCache.tensors()
    assert (pool.layers[0].kv_cache.scales[2:] == 7).all()  # the rest left alone


def test_blocks_written_before_their_first_use_are_not_zeroed_by_it(qwen3) -> None:
    """write_blocks counts as a first use: a later touch (the runner's, as a step
    writes its tokens) must not zero what it wrote."""
    source = small_pool(qwen3, [QuantizedSpec(width=3)])
    source.touch(10)
    for t in source.layers[0].kv_cache.tensors():
        t.copy_(torch.arange(t.numel()).view(t.shape))
    data = source.read_blocks([1, 6])
    assert data.num_blocks == 2 and data.nbytes() == 2 * QuantizedSpec(3).block_bytes(4)
    target = small_pool(qwen3, [QuantizedSpec(width=3)])
    target.write_blocks([8, 2], data)
    target.touch(10)
    got = target.read_blocks([8, 2])
    assert all(torch.equal(a, b) for a, b in zip(got.layers[0], data.layers[0]))
    assert target.layers[0].kv_cache.k[[0, 1, 3, 9]].count_nonzero() == 0  # zeroed, unwritten


def test_write_blocks_refuses_data_that_does_not_fit(qwen3) -> None:
    specs = [FullAttentionSpec(2, 8, torch.float32), LatentSpec(width=12)]
    pool = small_pool(qwen3, specs)
    data = pool.read_blocks([0, 1, 2])
    with pytest.raises(ValueError, match="data holds 3 blocks but 2 block ids were given"):
        pool.write_blocks([4, 5], data)
    with pytest.raises(ValueError, match=r"block ids \[10, -1\] are outside this pool's 10"):
        pool.write_blocks([3, 10, -1], data)
    with pytest.raises(ValueError, match=r"block ids \[11\] are outside"):
        pool.read_blocks([11])
    with pytest.raises(ValueError, match="repeat"):
        pool.write_blocks([4, 5, 4], data)
    other_size = small_pool(qwen3, specs, block_size=8).read_blocks([0, 1, 2])
    with pytest.raises(
        ValueError,
        match=r"layer 0 tensor 0: data is \(3, 8, 2, 8\) torch.float32"
        r"; this pool's blocks are \(3, 4, 2, 8\) torch.float32",
    ):
        pool.write_blocks([4, 5, 6], other_size)
    half = KVBlocks([[t.half() for t in ts] for ts in data.layers])
    with pytest.raises(ValueError, match=r"data is \(3, 4, 2, 8\) torch.float16; .* torch.float32"):
        pool.write_blocks([4, 5, 6], half)
    with pytest.raises(ValueError, match="data has 1 layers; this pool has 2"):
        pool.write_blocks([4, 5, 6], KVBlocks(data.layers[:1]))
    with pytest.raises(ValueError, match="layer 1: data has 2 tensors; this pool has 1"):
        pool.write_blocks([4, 5, 6], KVBlocks([data.layers[0], data.layers[0]]))
    pool.write_blocks([4, 5, 6], data)  # what does fit is written


@pytest.fixture(scope="module", params=["llama", "deepseek"])
def arch_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"{request.param}-kv-export")
    build_checkpoint(request.param, path)
    return path


def one_sequence(slots: list[int], table: list[int], context: int, decode: bool):
    """The step of one sequence whose new tokens go to ``slots``, over ``table``."""
    n = len(slots)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([table], dtype=torch.int32),
        context_lens=torch.tensor([context], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32),
        num_decodes=int(decode),
        context_lens_cpu=[context],
        query_lens_cpu=[n],
    )


def slots_of(table: list[int], positions: range, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def test_blocks_moved_to_another_pool_attend_the_same(arch_checkpoint) -> None:
    """A prompt fills blocks 0-2 of one engine's pool; they are read, and written
    into blocks 9, 4, 13 of a second engine's. A prompt chunk and then a decode
    over those blocks, each through its own block table, give bitwise the same
    hidden states in both engines (every layer attends over the moved blocks:
    prefill and decode paths, full attention and MLA), and the second pool reads
    back the same bytes."""
    bs, prompt = 4, 10
    runners = [
        LLM(
            arch_checkpoint, dtype="float32", block_size=bs, num_kv_blocks=16
        ).llm_engine.executor.model_runner
        for _ in range(2)
    ]
    tables = [[0, 1, 2, 3], [9, 4, 13, 7]]  # the prompt's three blocks, then one more
    ids = torch.tensor(random_prompts(1, seed=3, low=prompt + 4, high=prompt + 5)[0])
    pos = torch.arange(len(ids))
    model = runners[0].model
    fill = one_sequence(slots_of(tables[0], range(prompt), bs), tables[0][:3], prompt, False)
    run(runners[0], fill, lambda: model(ids[:prompt], pos[:prompt]))
    data = runners[0].kv_cache.read_blocks(tables[0][:3])
    assert len(data.layers) == len(model.attention_layers()) and data.num_blocks == 3
    assert all(t.device.type == "cpu" for ts in data.layers for t in ts)
    main = data.layers[: len(model.model.layers)]  # not DeepSeek's MTP layer, which this skips
    assert all(t.abs().sum() > 0 for ts in main for t in ts)  # the prompt was written
    runners[1].kv_cache.write_blocks(tables[1][:3], data)
    back = runners[1].kv_cache.read_blocks(tables[1][:3])
    for ours, theirs in zip(back.layers, data.layers):
        for a, b in zip(ours, theirs):
            assert a.view(torch.uint8).equal(b.view(torch.uint8))  # the same bytes

    outputs = []
    for runner, table in zip(runners, tables):
        chunk = one_sequence(slots_of(table, range(prompt, 13), bs), table, 13, False)
        hidden = [run(runner, chunk, lambda r=runner: r.model(ids[prompt:13], pos[prompt:13]))]
        decode = one_sequence(slots_of(table, range(13, 14), bs), table, 14, True)
        hidden.append(run(runner, decode, lambda r=runner: r.model(ids[13:14], pos[13:14])))
        outputs.append(torch.cat(hidden))
    assert outputs[0].abs().max() > 0.01
    assert torch.equal(outputs[0], outputs[1])
