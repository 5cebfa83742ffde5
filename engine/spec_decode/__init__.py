"""Speculative decoding (Chapter 5): a proposer guesses the tokens after a
request's newest one, and the target model checks them all in one forward pass.

engine/config/speculative.py says which proposer and how many drafts;
proposer.py is the interface every proposer meets, in the model runner
(engine/runner/drafting.py runs them after each step's sampling); ngram.py is prompt lookup, draft_model.py a small
model of the same vocabulary, mtp.py DeepSeek's multi-token prediction module; verify_length.py is the
scheduler's choice of how many drafts each request verifies. The rejection
sampler, which keeps the target's distribution exact when a draft was sampled
from a distribution q, is sampling's (engine/sample/rejection_sampler.py)."""

from engine.config.speculative import SpeculativeConfig
from engine.spec_decode.proposer import NO_DRAFT, Draft, DraftProposer, DraftRequest

__all__ = ["NO_DRAFT", "Draft", "DraftProposer", "DraftRequest", "SpeculativeConfig"]
