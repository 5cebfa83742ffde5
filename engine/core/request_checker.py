"""A request's checks, apart from the engine that will run it: whatever can be
wrong with a request is found here, before it is queued, so that a bad request
fails alone and nothing already queued is lost.

The checks need the tokenizer, the vocabulary, the maximum model length and the
grammar compiler, and no model. So a server whose engine core runs in another
process (entrypoints/core_process.py) runs the same checks in its front end,
and refuses a bad request with a 400 before it crosses to the core.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer

from engine.kv.handoff import Handoff
from engine.kv.store_connector import block_chain
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence
from engine.structured_output import StructuredOutputManager

Prompt = str | list[int]


@dataclass(frozen=True)
class BlockChain:
    """What a handed-on request's block hashes are checked against: the engine's
    chain root and block size (kv/hashing.py)."""

    root: bytes
    block_size: int

    def of(self, token_ids: list[int], n: int) -> list[bytes]:
        return block_chain(self.root, token_ids, self.block_size, n)


class RequestChecker:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        max_model_len: int,
        structured_output: StructuredOutputManager,
        seed: int,
        store_chain: BlockChain | None = None,  # None: no KV store, so no handoffs
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.structured_output = structured_output
        self.seed = seed
        self.store_chain = store_chain
        self.num_added = 0  # requests queued so far: the engine counts them

    def check(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        handoff: Handoff | None = None,
        seed: int | None = None,
    ) -> Sequence:
        """The request as a Sequence, tokenized and seeded; ValueError if it is bad.
        Without a seed of its own or ``seed`` (one a front end already gave it),
        it gets the engine's seed, mixed with the number of requests added before."""
        params = params or SamplingParams()
        self._check_logit_bias(params)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json; pass token ids")
            token_ids = self.tokenizer.encode(prompt).ids
        else:
            token_ids = list(prompt)
            self._check_ids("prompt token ids", token_ids)
        if not token_ids:
            raise ValueError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens, but the maximum model length is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        if params.seed is not None:
            seed = params.seed
        elif seed is None:
            seed = self.seed * 1_000_003 + self.num_added
        seq = Sequence(request_id, token_ids, params, seed=seed)
        if params.structured_outputs is not None:  # ValueError if it does not compile
            seq.structured_output = self.structured_output.request_for(params.structured_outputs)
        if handoff is not None:
            self._take_handoff(seq, handoff)
        return seq

    def _check_ids(self, what: str, token_ids: list[int]) -> None:
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"{what} must be integers in [0, {vocab})")

    def _check_logit_bias(self, params: SamplingParams) -> None:
        """Every token a logit_bias names must be in the model's vocabulary."""
        outside = sorted(t for t in params.logit_bias or {} if t >= self.vocab_size)
        if outside:
            raise ValueError(
                f"logit_bias names token id {outside[0]}, "
                f"outside the vocabulary [0, {self.vocab_size})"
            )

    def _take_handoff(self, seq: Sequence, handoff: Handoff) -> None:
        """Continue a request another engine began (kv/handoff.py): its tokens so
        far, checked, and its blocks to load from the store."""
        if self.store_chain is None:
            raise ValueError("a handed-on request needs a kv_store to load its blocks from")
        if seq.structured_output is not None or seq.params.prompt_logprobs is not None:
            raise ValueError(
                "a handed-on request cannot have structured outputs or prompt_logprobs"
            )
        n = len(handoff.block_hashes)
        mine = self.store_chain.of(seq.token_ids, n)
        if n > seq.num_prompt_tokens // self.store_chain.block_size or handoff.block_hashes != mine:
            raise ValueError(
                "the handed-on block hashes do not match this engine's: the sender serves "
                "another model, KV format or block size, or another prompt"
            )
        outputs = handoff.output_token_ids
        if not outputs:
            raise ValueError(
                f"handed-on output token ids must be integers in [0, {self.vocab_size})"
            )
        self._check_ids("handed-on output token ids", outputs)
        if (
            len(outputs) >= seq.params.max_tokens
            or seq.num_tokens + len(outputs) >= self.max_model_len
        ):
            raise ValueError("the handed-on request has no room left to generate")
        seq.token_ids += outputs
        seq.handoff = handoff
