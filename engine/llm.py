"""The offline API: LLM(model).generate(prompts) runs the engine loop until
every request is done, and returns the outputs in the order of the prompts."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from itertools import count
from typing import Any, TypedDict

from tqdm.auto import tqdm

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine, Prompt
from engine.distributed.balancer import RebalanceReport
from engine.kv.handoff import Handoff
from engine.outputs import RequestOutput
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.stats import EngineStats


class TextPrompt(TypedDict):
    """vLLM's text prompt: ``{"prompt": "text"}``."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's token prompt: ``{"prompt_token_ids": [ids]}``."""

    prompt_token_ids: list[int]


# What generate takes for one prompt: the engine's own forms (text, token ids),
# or vLLM's dicts of them.
PromptType = Prompt | TextPrompt | TokensPrompt
PROMPT_FORMS = "a string, a list of token ids, {'prompt': str} or {'prompt_token_ids': list[int]}"


class LLM:
    def __init__(self, model: str | os.PathLike, **kwargs: Any) -> None:
        """``kwargs`` are EngineConfig's fields (block_size, num_kv_blocks, seed, ...),
        with its defaults; an unknown name is a TypeError that names it."""
        config = EngineConfig(model=str(model), **kwargs)
        self.llm_engine = LLMEngine(config)
        self._ids = count()

    @property
    def stats(self) -> EngineStats:
        return self.llm_engine.stats

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        handoffs: list[Handoff | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in the prompts' order.
        ``handoffs``: for a prompt another engine began, what it handed on
        (kv/handoff.py; needs a kv_store)."""
        prompts, params, handoffs = per_prompt(prompts, sampling_params, handoffs)
        params = [replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        engine = self.llm_engine
        # Check every request before queueing any, so a bad one loses nothing.
        seqs = [
            engine.make_sequence(str(next(self._ids)), p, sp, h)
            for p, sp, h in zip(prompts, params, handoffs)
        ]
        for seq, prompt in zip(seqs, prompts):
            engine.add_sequence(seq, prompt)
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(seqs), desc="Generating", unit="req", disable=not use_tqdm) as bar:
            start, tokens = time.perf_counter(), engine.stats.generated_tokens
            while engine.has_unfinished_requests():
                for out in engine.step():  # finished requests only (FINAL_ONLY)
                    finished[out.request_id] = out
                    bar.update(1)
                rate = (engine.stats.generated_tokens - tokens) / (time.perf_counter() - start)
                bar.set_postfix_str(f"{rate:.0f} tok/s out")
        engine.settle()
        return [finished[seq.request_id] for seq in seqs]

    def rebalance_experts(self, num_redundant: int | None = None) -> RebalanceReport:
        """EPLB: re-place the routed experts for the load recorded so far (see
        ExpertBalancer.rebalance); the outputs do not change."""
        return self.llm_engine.eplb.rebalance(num_redundant)

    def shutdown(self) -> None:
        """Stop the expert-parallel workers now; ``del llm`` and exit do it too."""
        self.llm_engine.shutdown()

    def __del__(self) -> None:
        engine = getattr(self, "llm_engine", None)
        if engine is not None:
            engine.shutdown()


def per_prompt(
    prompts: PromptType | list[PromptType],
    sampling_params: SamplingParams | list[SamplingParams] | None,
    handoffs: list[Handoff | None] | None,
) -> tuple[list[Prompt], list[SamplingParams], list[Handoff | None]]:
    """generate's arguments as one prompt (text or token ids), one SamplingParams
    and one handoff (or None) per request; ValueError if the lists disagree in
    length, or for a prompt of no accepted form (parse_prompt)."""
    if not isinstance(prompts, list | tuple) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    prompts = [parse_prompt(p) for p in prompts]
    params = sampling_params or SamplingParams()
    if not isinstance(params, list):
        params = [params] * len(prompts)
    handoffs = handoffs or [None] * len(prompts)
    if len(params) != len(prompts) or len(handoffs) != len(prompts):
        raise ValueError(
            f"{len(prompts)} prompts but {len(params)} sampling params, {len(handoffs)} handoffs"
        )
    return prompts, params, handoffs


def parse_prompt(prompt: PromptType) -> Prompt:
    """One prompt as the engine takes it: vLLM's ``{"prompt": text}`` and
    ``{"prompt_token_ids": ids}`` become the text or the ids they hold. A dict of
    any other shape is a ValueError, a value or prompt of another type a
    TypeError, each naming the forms accepted. The ids are checked later, with
    the engine's other checks (RequestChecker)."""
    if isinstance(prompt, str | list | tuple):
        return prompt
    if not isinstance(prompt, dict):
        raise TypeError(f"a prompt must be {PROMPT_FORMS}, got {type(prompt).__name__}")
    if len(prompt) != 1 or next(iter(prompt)) not in ("prompt", "prompt_token_ids"):
        raise ValueError(f"a prompt must be {PROMPT_FORMS}, got a dict with keys {list(prompt)}")
    [(key, value)] = prompt.items()
    wanted = str if key == "prompt" else list
    if not isinstance(value, wanted):
        raise TypeError(f"a prompt must be {PROMPT_FORMS}, got {key!r} as {type(value).__name__}")
    return value
