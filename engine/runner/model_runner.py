"""The model runner: owns the model, the paged KV cache and the sampler, and
turns the scheduler's decision into one forward pass over a flattened batch.

It reads only a SchedulerOutput, which is plain data, and its own state for
each request; it knows nothing of the scheduler or its sequences."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from engine.attention.backend import get_backend
from engine.attention.context import forward_context
from engine.attention.metadata import AttentionMetadata, decode_query_len, for_decodes
from engine.config import EngineConfig
from engine.distributed.expert_parallel import ExpertLoad, broadcast_from_rank0
from engine.distributed.placement import ExpertPlacement
from engine.distributed.rank_experts import RankExperts
from engine.kv.kv_cache import KVBlocks, KVCacheConfig, KVCachePool
from engine.layers.batch_invariant import use_fixed_row_tiles
from engine.layers.linear import can_pack, pack_linears
from engine.layers.penalties import prompt_mask
from engine.layers.sampler import (
    GrammarMask,
    RandomRows,
    Sampler,
    SamplingMetadata,
    SamplingRow,
    adjust_logits,
    compute_logprobs,
)
from engine.models.base import CausalLM
from engine.models.loader import load_model
from engine.outputs import LogprobsTensors, ModelRunnerOutput
from engine.runner.compiled_decode import CompiledDecode, can_compile
from engine.runner.cuda_graph import CUDAGraphRunner
from engine.runner.fast_path import DecodeFastPath
from engine.runner.prompt_logprobs import (
    PromptLogprobs,
    PromptRows,
    fill_prompt_logprobs,
    prompt_rows,
)
from engine.sampling_params import SamplingParams
from engine.scheduler_output import (
    HOLE,
    GrammarOutput,
    ScheduledRequest,
    SchedulerOutput,
    padded,
)
from engine.spec_decode.mtp import MTPProposer, mtp_target
from engine.spec_decode.rejection_sampler import SampledDrafts, verify_sampled
from engine.stats import EngineStats
from engine.utils import cdiv, to_device


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens]
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows of the hidden states to turn into logits
    req_ids: list[str]  # the requests that sample, in the order of those rows
    # Per request that samples: the position of its first sampled token among its
    # output tokens, and its drafts, each checked at the row after the one before.
    first_outputs: list[int] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)
    # Per request that samples: its output tokens so far if its penalties need them, else None.
    output_token_ids: list[list[int] | None] = field(default_factory=list)
    # Per request that samples: the q its drafts were drawn from, or None (one-hot).
    draft_probs: list[torch.Tensor | None] = field(default_factory=list)
    # The step's requests in the batch's order (decodes first): an MTP drafter's rows.
    items: list[ScheduledRequest] = field(default_factory=list)
    # Positions whose logits score prompt tokens (prompt_logprobs), in logits_indices
    # after the sampled rows; None when no request asks this step.
    prompt: PromptRows | None = None

    def num_positions(self) -> list[int]:
        """Per request that samples, its rows of logits: its last token's, and each draft's."""
        return [1 + len(d) for d in self.drafts]


@dataclass
class DraftCheck:
    """On the device: the drafts of each request that sampled, padded with -1
    (which no sampled token equals), and the row of the token sampled before each."""

    drafts: torch.Tensor  # [requests, max drafts] int64
    rows: torch.Tensor  # [requests, max drafts] int64 indices into the sampled tokens
    # The sampled requests whose drafts carry q: the rejection sampler's (spec_decode/).
    sampled: SampledDrafts | None = None

    def num_accepted(self, sampled: torch.Tensor) -> torch.Tensor:
        """Strict match, left to right: drafts accepted until the first that differs
        from the token sampled at its position."""
        match = sampled[self.rows] == self.drafts
        return match.long().cumprod(dim=1).sum(dim=1)


@dataclass
class PreparedStep:
    """A step's inputs, built on the host: all that the forward pass and the
    sampler read, so that they can run on another thread or stream."""

    batch: ModelInput
    fast: bool  # run by the runner's DecodeFastPath (decodes only; fast_path.py)
    attn_metadata: Any  # what the backend's build_metadata built; None if the path builds its own
    sampling: SamplingMetadata
    future_slots: torch.Tensor | None = None  # async scheduling: see async_model_runner.py
    drafts: DraftCheck | None = None  # None when no request carries drafts


@dataclass
class CachedRequestState:
    """What the runner keeps for a request between its steps."""

    sampling_params: SamplingParams
    seed: int
    num_prompt_tokens: int  # a sampled token's output position is its position less these
    prompt_mask: torch.Tensor | None = None  # its prompt's tokens, for a repetition penalty
    prompt_logprobs: PromptLogprobs | None = None  # its list, while it fills


class ModelRunner:
    def __init__(
        self, config: EngineConfig, stats: EngineStats | None = None, rank: int = 0
    ) -> None:
        """``rank``: this runner's place in the expert-parallel group; rank 0 samples."""
        self.config = config
        self.stats = stats or EngineStats()
        self.rank = rank
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.backend = get_backend(
            config.attention_backend, config.device, config.block_size, config.batch_invariant
        )
        self.rank_experts = RankExperts(config, rank)  # distributed/rank_experts.py
        self.model = load_model(config, self.rank_experts.local_experts())
        self.compiled = self._compiled_decode()  # before packing: it may freeze the weights
        if config.batch_invariant:
            use_fixed_row_tiles(self.model)
        elif self.compiled is not None and self.compiled.freezes_weights:
            pass  # its graph packs them for its own kernels; prefill reads them as they are
        elif self.model.supports_packed_linears and can_pack(self.device, config.dtype):
            pack_linears(self.model)  # a CPU's matmuls, from weights laid out for them
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}
        # The requests whose prompt logprobs are not yet sent: while there are none,
        # a step computes logits for its sampled rows alone.
        self.pending_prompt_logprobs: dict[str, PromptLogprobs] = {}
        self.sampled_hidden_states: torch.Tensor | None = None  # of the last step (forward)
        self.step_hidden_states: torch.Tensor | None = None  # every position's, for a drafter
        self.rank_experts.bind(self.model, self.stats, self.device)
        mtp = self._mtp_target()
        layers = self.model.kv_cache_layers(config.block_size) + (
            mtp.mtp_attention_layers() if mtp else []
        )
        self.kv_cache = KVCachePool(config, layers, self.device)
        self.max_model_len = self.kv_cache.max_model_len
        self.drafter = self._mtp_drafter(mtp)
        if self.compiled is not None:
            self._compile_decode_now()
        self.graphs: CUDAGraphRunner | None = None
        if (
            self.device.type == "cuda"
            and self.backend.name == "triton"
            and not config.enforce_eager
            and self.model.supports_cuda_graphs
        ):
            c = config.hf_config
            self.graphs = CUDAGraphRunner(
                self.model,
                self.backend,
                min(config.max_num_seqs, 256),
                cdiv(self.max_model_len, self.block_size),
                c.hidden_size,
                config.dtype,
                self.device,
            )
        # At most one of the two: graphs need CUDA, the compiled decode a CPU.
        self.fast_path: DecodeFastPath | None = self.graphs or self.compiled

    def _mtp_target(self) -> CausalLM | None:
        """The model, if the engine drafts with its MTP module (spec_decode/mtp.py)."""
        spec = self.config.speculative_config
        return mtp_target(self.model) if spec is not None and spec.method == "mtp" else None

    def _mtp_drafter(self, mtp: CausalLM | None) -> MTPProposer | None:
        """The MTP drafter over the pool, which holds its module's cache too."""
        if mtp is None:
            return None
        k = self.config.speculative_config.num_speculative_tokens
        return MTPProposer(mtp, self.kv_cache, self.backend, k, self.config.max_num_seqs)

    def _compiled_decode(self) -> CompiledDecode | None:
        want = self.config.compile_decode
        if self.config.enforce_eager:
            why_not = "enforce_eager=True asks for no compilation"
        elif want is False:  # off (the default): skip the probe, seconds of compiler runs
            return None
        elif self.config.expert_parallel_size > 1:
            why_not = "under expert parallelism each MoE layer exchanges tokens between ranks"
        else:
            why_not = can_compile(self.model, self.device)
        if want and why_not:
            raise ValueError(f"compile_decode=True cannot be honoured: {why_not}")
        if want is False or why_not:  # None: wherever it can run
            return None
        return CompiledDecode(self.model, self.backend, self.config.compile_mode)

    def _compile_decode_now(self) -> None:
        """Compile before the first request rather than in the middle of it: a
        decode step of dummy sequences, one token each, in block 0, at each batch
        size that needs a graph of its own. What they write there is zeroed again
        before any request gets the block."""
        self.kv_cache.touch(1)
        with self._uncounted():
            self._compile_warm_steps()
        self.kv_cache.forget_touched()
        self.compiled.steps = 0

    def _compile_warm_steps(self) -> None:
        for n in self.compiled.warm_batches:
            ids, positions, meta = self._dummy_decodes(n)  # made outside inference mode
            with (
                torch.inference_mode(),
                forward_context(meta, self.backend.build_metadata(meta), self.backend),
            ):
                self.compiled(ids, positions)

    def _dummy_decodes(self, n: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A decode step of n dummy sequences, one token each at position 0, in
        block 0: their token ids, positions and attention metadata."""
        ids = self._tensor([0] * n, torch.int64)
        tables, lens = self._tensor([[0]] * n, torch.int32), self._tensor([1] * n, torch.int32)
        return ids, ids.clone(), for_decodes(ids.clone(), tables, lens, [1] * n)

    @contextmanager
    def _uncounted(self) -> Iterator[None]:
        """Dummy steps (a warm-up, a timing) route no real tokens: the MoE layers'
        counts, which EPLB and the metrics read, are put back as they were."""
        counts = self.stats.expert_tokens
        saved = None if counts is None else counts.clone()
        try:
            yield
        finally:
            if saved is not None:
                counts.copy_(saved)

    def kv_cache_config(self) -> KVCacheConfig:
        return self.kv_cache.kv_cache_config()

    def read_kv_blocks(self, block_ids: list[int]) -> KVBlocks:
        """Blocks of the pool, to the host (a KV store saves them; Chapter 8)."""
        return self.kv_cache.read_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: KVBlocks) -> None:
        """Blocks loaded from a KV store, into the pool, between steps."""
        self.kv_cache.write_blocks(block_ids, data)

    @torch.inference_mode()
    def measure_step_times(self, sizes: list[int]) -> list[float]:
        """Seconds of a decode step of n one-token sequences, for each n in
        ``sizes`` (the verify-length schedule's cost side): dummy sequences all
        in block 0, as _compile_decode_now's, the median of five runs after a
        warm-up. What they write is zeroed again before any request gets it."""
        times = []
        self.kv_cache.touch(1)
        with self._uncounted():
            for n in sizes:
                times.append(self._step_time(n))
        self.kv_cache.forget_touched()
        return times

    def _step_time(self, n: int) -> float:
        """The median of five decode steps of n dummy one-token sequences, after one."""
        ids, positions, meta = self._dummy_decodes(n)
        runs = []
        with forward_context(meta, self.backend.build_metadata(meta), self.backend):
            for _ in range(6):
                start = time.perf_counter()
                self.model.compute_logits(self.model(ids, positions))
                runs.append(time.perf_counter() - start)
        return sorted(runs[1:])[2]

    def expert_load(self) -> ExpertLoad | None:
        """What this rank's MoE layers recorded (see RankExperts.load)."""
        return self.rank_experts.load()

    def apply_placement(self, placement: ExpertPlacement) -> None:
        """Between steps: move this rank to a new placement (RankExperts.apply)."""
        self.rank_experts.apply(placement)

    def build_model_input(self, out: SchedulerOutput) -> ModelInput:
        """Flatten the scheduled requests into one batch, decodes first.

        For every new token: its id, its position in its own sequence, and the
        cache slot where its key and value will be written. For every sequence:
        its block table, its context length, and where its queries start.

        Under a kv_window, attention gets the blocks the sequence still holds, in
        order, and the tokens they hold as its context (kept_blocks), while the
        new tokens keep their real positions, for their slots and for RoPE. Every
        block given back lies before every query, so causal masking over the kept
        tokens still holds: a query attends to every kept token up to itself.
        """
        # --8<-- [start:flatten_batch]
        bs = self.block_size
        q = decode_query_len(max((item.num_drafts for item in out.scheduled), default=0))
        items = sorted(out.scheduled, key=lambda s: not is_decode(s, q))  # stable
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, context_lens, logits_indices, req_ids, tables = [], [], [], [], []
        for item in items:
            start = item.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids += item.token_ids
            positions += range(start, end)
            slots += [item.block_table[p // bs] * bs + p % bs for p in range(start, end)]
            query_lens.append(item.num_new_tokens)
            table, context = kept_blocks(item.block_table, end, bs)  # end, without a window
            tables.append(table)
            context_lens.append(context)
            if item.samples:  # the last token's hidden state, and each draft's, give a token
                logits_indices += range(len(input_ids) - 1 - item.num_drafts, len(input_ids))
                req_ids.append(item.req_id)
        tables = padded(tables)  # one width, with -1 (HOLE) after each shorter table
        # --8<-- [end:flatten_batch]
        if self.model.reads_block_holes:  # by position, holes and all (DeepSeek-V4)
            tables, context_lens = tables_with_holes(items)
        prompt = self._prompt_rows(items)
        if prompt is not None:  # logits for them too, after the sampled rows
            logits_indices += prompt.rows
        self.kv_cache.touch(max(slots) // bs + 1)  # new blocks are zeroed before use
        cu_seqlens = [0]
        for n in query_lens:
            cu_seqlens.append(cu_seqlens[-1] + n)
        num_decodes = sum(1 for item in items if is_decode(item, q))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            context_lens=self._tensor(context_lens, torch.int32),
            cu_seqlens_q=self._tensor(cu_seqlens, torch.int32),
            num_decodes=num_decodes if q == 1 else 0,  # see AttentionMetadata.num_decodes
            context_lens_cpu=context_lens,
            query_lens_cpu=query_lens,
            decode_query_len=q,
        )
        if self.model.reads_block_holes:  # and its row blocks (engine/kv/compressed_cache.py)
            row_tables = padded([item.row_table for item in items])
            self.kv_cache.touch(max((b for t in row_tables for b in t), default=-1) + 1)
            meta.row_tables = self._tensor(row_tables, torch.int32)
        sampling = [item for item in items if item.samples]
        return ModelInput(
            self._tensor(input_ids, torch.int64),
            self._tensor(positions, torch.int64),
            meta,
            self._tensor(logits_indices, torch.int64),
            req_ids,
            [self._first_output(item) for item in sampling],
            [item.draft_token_ids for item in sampling],
            [item.output_token_ids for item in sampling],
            [item.draft_probs for item in sampling],
            items,
            prompt,
        )

    def _prompt_rows(self, items: list[ScheduledRequest]) -> PromptRows | None:
        """The step's rows that score prompt tokens (prompt_logprobs.py); None at
        once while no request waits for its list."""
        if not self.pending_prompt_logprobs:
            return None
        prompt = prompt_rows(items, self.pending_prompt_logprobs)
        for req_id in prompt.due if prompt is not None else ():
            del self.pending_prompt_logprobs[req_id]  # sent with this step's token
        return prompt

    def _first_output(self, item: ScheduledRequest) -> int:
        """The output position of the token sampled after the item's last real token."""
        end = item.num_computed_tokens + item.num_new_tokens - item.num_drafts
        return end - self.requests[item.req_id].num_prompt_tokens

    def _tensor(self, data: list, dtype: torch.dtype) -> torch.Tensor:
        return to_device(data, dtype, self.device)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The host's share of a step: the flattened batch, and the attention and
        sampling metadata. Nothing here waits for the device. Each sampled row
        draws from its request's random stream at its token's output position, so
        a token is the same whether it is sampled after a draft or a step later."""
        self._update_states(scheduler_output)
        batch = self.build_model_input(scheduler_output)
        fast = self.fast_path is not None and self.fast_path.can_run(batch.meta)
        own = fast and self.fast_path.builds_own_metadata
        attn_metadata = None if own else self.backend.build_metadata(batch.meta)
        c = self.config.hf_config
        rows = self._sampling_rows(batch)
        sampling = SamplingMetadata.from_rows(rows, c.vocab_size, self.device, c.eos_token_ids)
        sampling.grammar = self._grammar_mask(scheduler_output.grammar, batch)
        drafts = self._draft_check(batch, rows)
        return PreparedStep(batch, fast, attn_metadata, sampling, drafts=drafts)

    def _sampling_rows(self, batch: ModelInput) -> list[SamplingRow]:
        """A row per sampled position: its request's settings and random stream, its
        output position, and for penalties the output before it (drafts included)."""
        rows = []
        for req_id, first, drafts, output in zip(
            batch.req_ids, batch.first_outputs, batch.drafts, batch.output_token_ids
        ):
            s = self.requests[req_id]
            for j in range(1 + len(drafts)):
                before = None if output is None else output + drafts[:j]
                rows.append(
                    SamplingRow(s.sampling_params, s.seed, first + j, before, s.prompt_mask)
                )
        return rows

    def _draft_check(self, batch: ModelInput, rows: list[SamplingRow]) -> DraftCheck | None:
        """What acceptance compares, on the device; None without drafts. ``rows``:
        the step's sampling rows, whose settings the rejection sampler's p needs."""
        width = max((len(d) for d in batch.drafts), default=0)
        if width == 0:
            return None
        drafts, check_rows, start = [], [], 0
        for n, d in zip(batch.num_positions(), batch.drafts):
            drafts.append(d + [-1] * (width - len(d)))
            check_rows.append([start + min(j, n - 1) for j in range(width)])
            start += n
        check = DraftCheck(self._tensor(drafts, torch.int64), self._tensor(check_rows, torch.int64))
        check.sampled = self._sampled_drafts(batch, rows, check_rows)
        return check

    def _sampled_drafts(
        self, batch: ModelInput, rows: list[SamplingRow], check_rows: list[list[int]]
    ) -> SampledDrafts | None:
        """The drafts with a q of the requests that draw (a greedy one's strict
        match is already the rejection rule); None if there are none."""
        picked = [
            i
            for i, (req_id, q) in enumerate(zip(batch.req_ids, batch.draft_probs))
            if q is not None and not self.requests[req_id].sampling_params.greedy
        ]
        if not picked:
            return None
        width, vocab = len(check_rows[0]), self.config.hf_config.vocab_size
        probs = torch.zeros(len(picked), width, vocab, device=self.device)
        for r, i in enumerate(picked):
            probs[r, : len(batch.drafts[i])] = batch.draft_probs[i].to(self.device, torch.float32)
        positions = [rows[j] for i in picked for j in check_rows[i]]
        return SampledDrafts(
            index=self._tensor(picked, torch.int64),
            rows=self._tensor([check_rows[i] for i in picked], torch.int64),
            drafts=self._tensor([pad(batch.drafts[i], width) for i in picked], torch.int64),
            num_drafts=self._tensor([len(batch.drafts[i]) for i in picked], torch.int64),
            probs=probs,
            filters=RandomRows.from_rows(positions, vocab, self.device),
        )

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> torch.Tensor:
        """One forward pass; logits only for the rows that will sample, and for the
        prompt rows of requests that asked for prompt_logprobs."""
        batch = step.batch
        start = time.perf_counter()
        if step.fast:  # decodes alone: CUDA graphs or the compiled decode (fast_path.py)
            args = batch.input_ids, batch.positions, batch.meta, step.attn_metadata
            hidden = self.fast_path.run(*args)
        else:
            with forward_context(batch.meta, step.attn_metadata, self.backend):
                hidden = self.model(batch.input_ids, batch.positions)
        # The sampled positions' last hidden states, in row order: what a draft
        # proposer (an MTP module, EAGLE) would start from.
        self.sampled_hidden_states = hidden[batch.logits_indices]
        if self.drafter is not None:
            self.step_hidden_states = hidden
        logits = self.model.compute_logits(self.sampled_hidden_states).float()
        self.stats.forward_seconds += time.perf_counter() - start
        return logits

    @torch.inference_mode()
    def execute_prepared(self, step: PreparedStep) -> ModelRunnerOutput:
        """The device's share of a step: the forward pass, then a token for every
        request whose new tokens reach its end. The tokens stay on the device.
        Only rank 0 samples; another rank's forward pass serves its experts. Then
        an MTP drafter drafts after each request's newest token, on every rank."""
        logits = self.forward(step)
        logits, prompt = self._split_prompt_logits(step.batch, logits)
        output = self._sample(step, logits) if self.rank == 0 else None
        if output is not None and prompt is not None:
            output.prompt_logprobs = prompt
        if self.drafter is not None:
            tokens, accepted = self._from_rank0(step, output)
            batch, hidden = step.batch, self.step_hidden_states
            drafts = self.drafter.propose(batch.items, batch.input_ids, hidden, tokens, accepted)
            if output is not None:
                output.draft_token_ids = drafts
        return output

    def _split_prompt_logits(
        self, batch: ModelInput, logits: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, LogprobsTensors] | None]:
        """The sampled rows' logits, and (rank 0) the prompt logprobs due this step;
        the logits unchanged when no request asked."""
        if batch.prompt is None:
            return logits, None
        n = logits.shape[0] - len(batch.prompt.rows)
        self.sampled_hidden_states = self.sampled_hidden_states[:n]
        due = fill_prompt_logprobs(batch.prompt, logits[n:]) if self.rank == 0 else None
        return logits[:n], due

    def _sample(self, step: PreparedStep, logits: torch.Tensor) -> ModelRunnerOutput:
        """Rank 0's share: a token for every sampled row, and the drafts each accepts."""
        sampled = self.sampler(logits, step.sampling)
        tokens, batch = sampled.sampled_token_ids, step.batch
        if step.drafts is None:
            return ModelRunnerOutput(batch.req_ids, tokens, sampled.logprobs)
        accepted = step.drafts.num_accepted(tokens)
        logprobs = sampled.logprobs
        if (sd := step.drafts.sampled) is not None:  # drafts drawn from a q: spec_decode/
            allowed = adjust_logits(logits, step.sampling)
            tokens, accepted = verify_sampled(allowed, tokens, accepted, sd)
            logprobs = compute_logprobs(logits, tokens, step.sampling.max_num_logprobs)
        return ModelRunnerOutput(batch.req_ids, tokens, logprobs, batch.num_positions(), accepted)

    def _from_rank0(
        self, step: PreparedStep, output: ModelRunnerOutput | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's sampled tokens and accepted drafts (None: no drafts), on every
        rank: under expert parallelism every rank runs the MTP module's MoE layers,
        so every rank drafts from rank 0's tokens, which it sends the others."""
        if self.config.expert_parallel_size == 1:
            return output.sampled_token_ids, output.num_accepted
        batch = step.batch
        if output is None:  # another rank: room for what rank 0 sends
            empty = partial(torch.empty, dtype=torch.int64, device=self.device)
            accepted = None if step.drafts is None else empty(len(batch.req_ids))
            output = ModelRunnerOutput(batch.req_ids, empty(sum(batch.num_positions())))
            output.num_accepted = accepted
        tokens = broadcast_from_rank0(output.sampled_token_ids)
        if output.num_accepted is None:
            return tokens, None
        return tokens, broadcast_from_rank0(output.num_accepted)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: prepare its inputs, then run it."""
        return self.execute_prepared(self.prepare_inputs(scheduler_output))

    def _grammar_mask(self, grammar: GrammarOutput | None, batch: ModelInput) -> GrammarMask | None:
        """The step's grammar masks, on the device, with the rows they belong to:
        a request's first mask is for its first sampled row, each next one for
        the row after (its drafts' positions, in order)."""
        if grammar is None:
            return None
        starts = [0]
        for n in batch.num_positions():
            starts.append(starts[-1] + n)
        row = dict(zip(batch.req_ids, starts))
        rows = self._tensor(grammar_rows(grammar.req_ids, row), torch.int64)
        return GrammarMask(rows, grammar.bitmask.to(self.device, non_blocking=True))

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the requests that ended; keep what new ones need for sampling."""
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)  # an abort may come before its first step
            self.pending_prompt_logprobs.pop(req_id, None)
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_req_ids)
        for new in scheduler_output.new_requests:
            state = CachedRequestState(new.sampling_params, new.seed, new.num_prompt_tokens)
            vocab = self.config.hf_config.vocab_size
            if new.sampling_params.repetition_penalty != 1.0:
                state.prompt_mask = prompt_mask(new.prompt_token_ids, vocab, self.device)
            if (k := new.sampling_params.prompt_logprobs) is not None:
                ids = new.prompt_token_ids
                state.prompt_logprobs = PromptLogprobs.empty(ids, min(k, vocab), self.device)
                self.pending_prompt_logprobs[new.req_id] = state.prompt_logprobs
            self.requests[new.req_id] = state


def tables_with_holes(items: list[ScheduledRequest]) -> tuple[list[list[int]], list[int]]:
    """Each sequence's whole block table, a window's holes (HOLE, -1) left where they
    are and padded with -1, and its real length once the step is done."""
    ends = [item.num_computed_tokens + item.num_new_tokens for item in items]
    return padded([item.block_table for item in items]), ends


def kept_blocks(block_table: list[int], end: int, block_size: int) -> tuple[list[int], int]:
    """What attention reads of a sequence whose cache will hold ``end`` tokens:
    its blocks without a kv_window's holes, and how many tokens they hold (each
    hole was a whole block, before every new token)."""
    if HOLE not in block_table:
        return block_table, end
    kept = [b for b in block_table if b != HOLE]
    return kept, end - (len(block_table) - len(kept)) * block_size


def grammar_rows(req_ids: list[str], first_row: dict[str, int]) -> list[int]:
    """The sampled row of each mask: a request's k-th mask is for the k-th row
    after its first."""
    seen: dict[str, int] = {}
    rows = []
    for req_id in req_ids:
        seen[req_id] = seen.get(req_id, -1) + 1
        rows.append(first_row[req_id] + seen[req_id])
    return rows


def pad(drafts: list[int], width: int) -> list[int]:
    """A request's drafts padded with token 0 to ``width`` (its count masks the rest)."""
    return drafts + [0] * (width - len(drafts))


def is_decode(item: ScheduledRequest, query_len: int) -> bool:
    """Is the item one of the step's decodes, whose query is ``query_len`` tokens:
    its newest token, then the drafts that make up the rest?"""
    return item.num_new_tokens == query_len == decode_query_len(item.num_drafts)
