"""The model runner: owns the model, the paged KV cache and the sampler, and
turns the scheduler's decision into one forward pass over a flattened batch."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, forward_context, get_backend
from engine.config import EngineConfig
from engine.cuda_graph import CUDAGraphRunner
from engine.layers.sampler import Sampler, SamplingRow
from engine.loader import load_model
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.stats import EngineStats


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to turn into logits
    sampled: list[Sequence]  # the sequences those rows belong to


class ModelRunner:
    def __init__(self, config: EngineConfig, stats: EngineStats | None = None) -> None:
        self.config = config
        self.stats = stats or EngineStats()
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.backend = get_backend(config.attention_backend, config.device)
        self.model = load_model(config)
        if self.backend.name == "triton":  # fused kernels for norms and RoPE too
            for module in self.model.modules():
                if hasattr(module, "use_triton"):
                    module.use_triton = True
        self.sampler = Sampler()
        self._bind_expert_counts()
        self.num_kv_blocks = config.num_kv_blocks or self._blocks_that_fit()
        self.max_model_len = self._max_model_len()
        if self._layer_specs():
            self.kv_cache = self._allocate_layer_caches(self.num_kv_blocks)
        else:
            self.kv_cache = self._allocate_kv_cache(self.num_kv_blocks)
        self.graphs: CUDAGraphRunner | None = None
        if (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not config.enforce_eager
            and getattr(self.model, "supports_cuda_graphs", True)
        ):
            c = config.hf_config
            self.graphs = CUDAGraphRunner(
                self.model,
                self.backend,
                min(config.max_num_seqs, 256),
                -(-self.max_model_len // self.block_size),
                c.hidden_size,
                config.dtype,
                self.device,
            )

    def _bind_expert_counts(self) -> None:
        """Every MoE layer counts its tokens into a row of one tensor in the stats."""
        experts = self.model.experts() if hasattr(self.model, "experts") else []
        if experts:
            counts = torch.zeros(
                len(experts), experts[0].num_experts, dtype=torch.int64, device=self.device
            )
            for row, layer in zip(counts, experts):
                layer.token_counts = row
            self.stats.expert_tokens = counts

    def _layer_specs(self) -> list:
        """The caches of layers that describe their own (MLA), until the engine-seams
        KV cache pool, which will size every layer this way, replaces this."""
        layers = self.model.attention_layers()
        if not hasattr(layers[0], "kv_cache_spec"):
            return []
        return [layer.kv_cache_spec(self.config.dtype) for layer in layers]

    def _allocate_layer_caches(self, num_blocks: int) -> torch.Tensor:
        for layer, spec in zip(self.model.attention_layers(), self._layer_specs()):
            layer.kv_cache = spec.allocate(num_blocks, self.block_size, self.device)
        return torch.empty(0)

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """One tensor for the whole cache: [k/v, layer, block, slot, kv_head, head_dim].

        Each attention layer gets views of its own slice. A token's keys and
        values for every layer live at the same (block, slot) address, so one
        block table serves all layers.
        """
        c = self.config.hf_config
        shape = (
            2,
            c.num_hidden_layers,
            num_blocks,
            self.block_size,
            c.num_key_value_heads,
            c.head_dim,
        )
        # Zeros, not empty: padded reads are masked, but 0 * NaN would still be NaN.
        kv_cache = torch.zeros(shape, dtype=self.config.dtype, device=self.device)
        for i, attn in enumerate(self.model.attention_layers()):
            attn.k_cache, attn.v_cache = kv_cache[0, i], kv_cache[1, i]
        return kv_cache

    def _max_model_len(self) -> int:
        """The longest sequence we accept: the checkpoint's limit, and no more than
        the whole cache holds (so a lone sequence can always run to the end)."""
        cfg = self.config
        limit = cfg.hf_config.max_position_embeddings
        capacity = self.num_kv_blocks * cfg.block_size
        if cfg.max_model_len is None:
            return min(limit, capacity)
        if cfg.max_model_len > limit:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} exceeds the model's "
                f"max_position_embeddings {limit}"
            )
        if cfg.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} does not fit in the KV cache "
                f"({self.num_kv_blocks} blocks of {cfg.block_size} = {capacity} tokens); "
                "raise num_kv_blocks or lower max_model_len"
            )
        return cfg.max_model_len

    def block_bytes(self) -> int:
        if self._layer_specs():
            return sum(spec.block_bytes(self.block_size) for spec in self._layer_specs())
        c = self.config.hf_config
        itemsize = torch.empty(0, dtype=self.config.dtype).element_size()
        return (
            2
            * c.num_hidden_layers
            * self.block_size
            * c.num_key_value_heads
            * c.head_dim
            * itemsize
        )

    def _blocks_that_fit(self) -> int:
        """Size the cache from a share of free memory, but never beyond what
        max_num_seqs sequences of the longest allowed length could use."""
        cfg = self.config
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = free * (cfg.kv_cache_memory_fraction or 0.9)
        else:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            budget = available * (cfg.kv_cache_memory_fraction or 0.2)
        longest = cfg.max_model_len or cfg.hf_config.max_position_embeddings
        useful = cfg.max_num_seqs * -(-longest // self.block_size)
        return max(1, min(int(budget // self.block_bytes()), useful))

    def prepare(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled sequences into one batch, decodes first.

        For every new token: its id, its position in its own sequence, and the
        cache slot where its key and value will be written. For every sequence:
        its block table, its context length, and where its queries start.
        """
        # --8<-- [start:flatten_batch]
        bs = self.block_size
        items = sorted(out.scheduled, key=lambda s: s.num_new_tokens != 1)  # stable
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, logits_indices, sampled = [], [], [], []
        for item in items:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            if item.samples:  # the last token's hidden state gives the next token
                logits_indices.append(len(input_ids) - 1)
                sampled.append(seq)
        width = max(len(item.seq.block_table) for item in items)
        tables = [it.seq.block_table + [-1] * (width - len(it.seq.block_table)) for it in items]
        # --8<-- [end:flatten_batch]
        cu_seqlens = [0]
        for n in query_lens:
            cu_seqlens.append(cu_seqlens[-1] + n)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            num_decodes=sum(1 for n in query_lens if n == 1),
            context_lens_cpu=context_lens,
            query_lens_cpu=query_lens,
        )
        return ModelInput(
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(logits_indices, torch.int64),
            sampled,
        )

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        t = torch.tensor(data, dtype=dtype)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    @torch.inference_mode()
    def forward(self, out: SchedulerOutput) -> tuple[ModelInput, torch.Tensor]:
        """One forward pass; logits only for the rows that will sample."""
        batch = self.prepare(out)
        self.backend.prepare(batch.meta, self.block_size)
        start = time.perf_counter()
        if self.graphs is not None and self.graphs.can_run(batch.meta):
            hidden = self.graphs.run(batch.input_ids, batch.positions, batch.meta)
        else:
            with forward_context(batch.meta, self.backend):
                hidden = self.model(batch.input_ids, batch.positions)
        logits = self.model.compute_logits(hidden[batch.logits_indices]).float()
        self.stats.forward_seconds += time.perf_counter() - start
        return batch, logits

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> tuple[list[Sequence], list[int], list]:
        """Run one step. Returns the sequences that sampled, their new tokens,
        and, for requests that asked, the logprobs of those tokens."""
        batch, logits = self.forward(out)
        if not batch.sampled:  # only chunks of prompts this step: nothing to sample
            return [], [], []
        rows = [SamplingRow(s.params, s.seed, s.num_output_tokens) for s in batch.sampled]
        tokens = self.sampler(logits, rows)
        return batch.sampled, tokens, self.sampler.logprobs(logits, tokens, rows)
