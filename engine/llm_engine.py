"""The engine loop: requests in, one scheduled forward pass per step, outputs out.

This is the API a server drives (add_request, step, abort_request); LLM.generate
in llm.py is the same loop run to completion.
"""

from __future__ import annotations

import time
from pathlib import Path

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import (
    detokenize_incrementally,
    find_stop_string,
    flush_detokenizer,
    start_detokenizer,
    visible_text,
)
from engine.loader import load_tokenizer
from engine.model_runner import ModelRunner
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence
from engine.stats import EngineStats

Prompt = str | list[int]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer = load_tokenizer(Path(config.model))
        self.stats = EngineStats()
        self.model_runner = ModelRunner(config, self.stats)
        self.max_model_len = self.model_runner.max_model_len
        self.eos_token_ids = set(config.hf_config.eos_token_ids)
        self.block_manager = BlockManager(
            self.model_runner.num_kv_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            config.max_num_seqs, config.max_num_batched_tokens, self.block_manager, self.stats
        )
        self.requests: dict[str, Sequence] = {}
        self._num_added = 0

    def make_sequence(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> Sequence:
        """Check a request and tokenize it, without touching the engine's state,
        so a bad request fails alone and nothing already queued is lost."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json; pass token ids")
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = list(prompt)
            vocab = self.config.hf_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but the maximum model length is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        seed = (
            params.seed
            if params.seed is not None
            else self.config.seed * 1_000_003 + self._num_added
        )
        prompt_text = prompt if isinstance(prompt, str) else None
        return Sequence(request_id, token_ids, params, prompt=prompt_text, seed=seed)

    def add_sequence(self, seq: Sequence) -> None:
        start_detokenizer(seq)
        seq.metrics["arrival"] = time.perf_counter()
        self.requests[seq.request_id] = seq
        self.scheduler.add(seq)
        self._num_added += 1

    def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams | None = None
    ) -> None:
        self.add_sequence(self.make_sequence(request_id, prompt, params))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort_request(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            del self.requests[request_id]

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, and fold the new tokens into each request."""
        start = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            raise RuntimeError("requests are waiting but none could be scheduled")
        seqs, tokens, logprobs = self.model_runner.execute(out)
        self.scheduler.advance(out)
        outputs = [self._append_token(seq, t, lp) for seq, t, lp in zip(seqs, tokens, logprobs)]
        self.stats.step_seconds += time.perf_counter() - start
        return outputs

    def _append_token(self, seq: Sequence, token: int, logprobs: dict | None) -> RequestOutput:
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        self.stats.generated_tokens += 1
        seq.metrics.setdefault("first_token", time.perf_counter())
        new_text = detokenize_incrementally(self.tokenizer, seq) if self.tokenizer else ""
        seq.text += new_text
        cut = find_stop_string(seq, new_text)  # a stop string ends the text early
        reason = "stop" if cut else self._stop_reason(seq, token)
        if reason is not None:
            if not cut and self.tokenizer:  # the text must equal decoding every token
                seq.text += flush_detokenizer(self.tokenizer, seq)
            self._finish(seq, reason)
        return self._output(seq)

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.metrics["finished"] = time.perf_counter()
        self.stats.finished_requests += 1
        del self.requests[seq.request_id]

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=visible_text(seq),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            metrics=dict(seq.metrics),
        )
