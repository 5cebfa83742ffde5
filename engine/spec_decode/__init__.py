"""Speculative decoding (Chapter 5): a proposer guesses the tokens after a
request's newest one, and the target model checks them all in one forward pass.

config.py says which proposer and how many drafts; proposer.py is the interface
the scheduler calls; ngram.py is prompt lookup; rejection_sampler.py keeps the
target's distribution exact when a draft was sampled from a distribution q."""

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.proposer import NO_DRAFT, Draft, DraftProposer

__all__ = ["NO_DRAFT", "Draft", "DraftProposer", "SpeculativeConfig"]
