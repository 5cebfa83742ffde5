"""The model runner: owns the model, the paged KV cache and the sampler, and
turns the scheduler's decision into one forward pass over a flattened batch.

It reads only a SchedulerOutput, which is plain data, and its own state for
each request; it knows nothing of the scheduler or its sequences. Its parts
each have a module: the requests and the step's batch (input_batch.py), the
proposers (drafting.py), the warm-up steps (warmup.py), the decode fast paths
(compiled_decode.py, cuda_graph.py) and this rank's experts
(distributed/rank_experts.py)."""

from __future__ import annotations

import time

import torch

from engine.attention.backend import get_backend
from engine.attention.context import forward_context
from engine.config import EngineConfig
from engine.distributed.expert_parallel import ExpertLoad
from engine.distributed.placement import ExpertPlacement
from engine.distributed.rank_experts import RankExperts
from engine.kv.kv_cache import KVBlocks, KVCacheConfig, KVCachePool
from engine.layers.batch_invariant import use_fixed_row_tiles
from engine.layers.linear import can_pack, pack_linears
from engine.models.base import CausalLM
from engine.models.loader import load_model
from engine.outputs import LogprobsTensors, ModelRunnerOutput
from engine.runner import warmup
from engine.runner.compiled_decode import compiled_decode_for
from engine.runner.cuda_graph import cuda_graphs_for
from engine.runner.drafting import Drafter, HiddenDrafts, TokenDrafts, draft_check
from engine.runner.fast_path import DecodeFastPath
from engine.runner.input_batch import CachedRequestState, InputBatch, ModelInput, PreparedStep
from engine.sample.prompt_logprobs import fill_prompt_logprobs
from engine.sample.rejection_sampler import verify_sampled
from engine.sample.sampler import Sampler, SamplingMetadata, adjust_logits, compute_logprobs
from engine.scheduler_output import SchedulerOutput
from engine.spec_decode.factory import make_proposer
from engine.spec_decode.mtp import MTPProposer, mtp_target
from engine.stats import EngineStats


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
        self.vocab_size = config.hf_config.vocab_size
        self.backend = get_backend(
            config.attention_backend, config.device, config.block_size, config.batch_invariant
        )
        self.rank_experts = RankExperts(config, rank)  # distributed/rank_experts.py
        self.model = load_model(config, self.rank_experts.local_experts())
        # Before packing: it may freeze the weights.
        self.compiled = compiled_decode_for(config, self.model, self.backend, self.device)
        self._lay_out_weights()
        self.sampler = Sampler()
        self.rank_experts.bind(self.model, self.stats, self.device)
        mtp = self._mtp_target()
        self.kv_cache = self._kv_pool(mtp)
        self.max_model_len = self.kv_cache.max_model_len
        self.num_kv_blocks = self.kv_cache.num_blocks
        self.input_batch = InputBatch(
            self.kv_cache, self.device, self.vocab_size, self.model.reads_block_holes
        )
        self.drafter: Drafter | None = self._drafter(mtp)
        if self.compiled is not None:
            warmup.compile_decode_now(
                self.compiled, self.backend, self.kv_cache, self.stats, self.device
            )
        self.graphs = cuda_graphs_for(
            config, self.model, self.backend, self.max_model_len, self.device
        )
        # At most one of the two: graphs need CUDA, the compiled decode a CPU.
        self.fast_path: DecodeFastPath | None = self.graphs or self.compiled
        self.sampled_hidden_states: torch.Tensor | None = None  # of the last step (forward)
        self.step_hidden_states: torch.Tensor | None = None  # every position's, for MTP

    def _lay_out_weights(self) -> None:
        """Batch-invariant tiles, or a CPU's packed matmul weights, or neither."""
        if self.config.batch_invariant:
            use_fixed_row_tiles(self.model)
        elif self.compiled is not None and self.compiled.freezes_weights:
            pass  # its graph packs them for its own kernels; prefill reads them as they are
        elif self.model.supports_packed_linears and can_pack(self.device, self.config.dtype):
            pack_linears(self.model)  # a CPU's matmuls, from weights laid out for them

    def _mtp_target(self) -> CausalLM | None:
        """The model, if the engine drafts with its MTP module (spec_decode/mtp.py)."""
        spec = self.config.speculative_config
        return mtp_target(self.model) if spec is not None and spec.method == "mtp" else None

    def _kv_pool(self, mtp: CausalLM | None) -> KVCachePool:
        """The paged cache of every attention layer, an MTP module's included."""
        extra = mtp.mtp_attention_layers() if mtp is not None else []
        layers = [*self.model.kv_cache_layers(self.block_size), *extra]
        return KVCachePool(self.config, layers, self.device)

    def _drafter(self, mtp: CausalLM | None) -> Drafter | None:
        """The proposer of the speculative_config, run here after sampling (drafting.py)."""
        spec = self.config.speculative_config
        if mtp is not None:  # over the pool, which holds its module's cache too
            k, n = spec.num_speculative_tokens, self.config.max_num_seqs
            proposer = MTPProposer(mtp, self.kv_cache, self.backend, k, n)
            return HiddenDrafts(proposer, self.config.expert_parallel_size)
        blocks, length = self.num_kv_blocks, self.max_model_len
        proposer = make_proposer(self.config, blocks, length, ModelRunner)
        return None if proposer is None else TokenDrafts(proposer, self.input_batch.requests)

    @property
    def requests(self) -> dict[str, CachedRequestState]:
        """The requests this runner holds state for (InputBatch.requests)."""
        return self.input_batch.requests

    def kv_cache_config(self) -> KVCacheConfig:
        return self.kv_cache.kv_cache_config()

    def read_kv_blocks(self, block_ids: list[int]) -> KVBlocks:
        """Blocks of the pool, to the host (a KV store saves them; Chapter 8)."""
        return self.kv_cache.read_blocks(block_ids)

    def write_kv_blocks(self, block_ids: list[int], data: KVBlocks) -> None:
        """Blocks loaded from a KV store, into the pool, between steps."""
        self.kv_cache.write_blocks(block_ids, data)

    def measure_step_times(self, sizes: list[int]) -> list[float]:
        """Seconds of a decode step of n one-token sequences, for each n (warmup.py)."""
        args = self.model, self.backend, self.kv_cache, self.stats, sizes, self.device
        return warmup.measure_step_times(*args)

    def expert_load(self) -> ExpertLoad | None:
        """What this rank's MoE layers recorded (see RankExperts.load)."""
        return self.rank_experts.load()

    def apply_placement(self, placement: ExpertPlacement) -> None:
        """Between steps: move this rank to a new placement (RankExperts.apply)."""
        self.rank_experts.apply(placement)

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The host's share of a step: the flattened batch, and the attention and
        sampling metadata. Nothing here waits for the device. Each sampled row
        draws from its request's random stream at its token's output position, so
        a token is the same whether it is sampled after a draft or a step later."""
        self._update_states(scheduler_output)
        batch = self.input_batch.build(scheduler_output)
        fast = self.fast_path is not None and self.fast_path.can_run(batch.meta)
        own = fast and self.fast_path.builds_own_metadata
        attn_metadata = None if own else self.backend.build_metadata(batch.meta)
        rows = self.input_batch.sampling_rows(batch)
        eos = self.config.hf_config.eos_token_ids
        sampling = SamplingMetadata.from_rows(rows, self.vocab_size, self.device, eos)
        sampling.grammar = self.input_batch.grammar_mask(scheduler_output.grammar, batch)
        drafts = None
        if self.drafter is not None:
            drafts = draft_check(batch, rows, self.drafter, self.vocab_size, self.device)
        return PreparedStep(batch, fast, attn_metadata, sampling, drafts=drafts)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Forget the requests that ended, here and in the drafter; keep new ones."""
        self.input_batch.update_states(scheduler_output)
        if self.drafter is not None:
            self.drafter.forget(scheduler_output.finished_req_ids)

    @torch.inference_mode()
    def forward(self, step: PreparedStep) -> torch.Tensor:
        """One forward pass; logits only for the rows that will sample, and for the
        prompt rows of requests that asked for prompt_logprobs. The sampled rows'
        last hidden states are kept, in row order: what a draft proposer such as
        the MTP module starts from; every position's too while it drafts."""
        batch = step.batch
        start = time.perf_counter()
        if step.fast:  # decodes alone: CUDA graphs or the compiled decode (fast_path.py)
            args = batch.input_ids, batch.positions, batch.meta, step.attn_metadata
            hidden = self.fast_path.run(*args)
        else:
            with forward_context(batch.meta, step.attn_metadata, self.backend):
                hidden = self.model(batch.input_ids, batch.positions)
        self.sampled_hidden_states = hidden[batch.logits_indices]
        reads = self.drafter is not None and self.drafter.reads_hidden
        self.step_hidden_states = hidden if reads else None
        logits = self.model.compute_logits(self.sampled_hidden_states).float()
        self.stats.forward_seconds += time.perf_counter() - start
        return logits

    def logits_for(self, out: SchedulerOutput) -> tuple[torch.Tensor, list[str]]:
        """One forward pass over ``out``, without sampling: the sampled rows'
        logits, and their request ids in row order (a draft model's pass)."""
        step = self.prepare_inputs(out)
        return self.forward(step), step.batch.req_ids

    @torch.inference_mode()
    def execute_prepared(self, step: PreparedStep) -> ModelRunnerOutput:
        """The device's share of a step: the forward pass, then a token for every
        request whose new tokens reach its end. The tokens stay on the device.
        Only rank 0 samples; another rank's forward pass serves its experts. Then
        the drafter proposes after each request's newest token (drafting.py)."""
        logits = self.forward(step)
        logits, prompt = self._split_prompt_logits(step.batch, logits)
        output = self._sample(step, logits) if self.rank == 0 else None
        if output is not None and prompt is not None:
            output.prompt_logprobs = prompt
        if self.drafter is not None:
            self.drafter.propose(step, output, self.step_hidden_states)
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

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step: prepare its inputs, then run it."""
        return self.execute_prepared(self.prepare_inputs(scheduler_output))
