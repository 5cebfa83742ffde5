"""The proposer a speculative_config asks for."""

from __future__ import annotations

from engine.spec_decode.config import SpeculativeConfig
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import DraftProposer


def make_proposer(config: SpeculativeConfig | None) -> DraftProposer | None:
    """None without speculation. SpeculativeConfig refuses the methods not built."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer.from_config(config)
    raise ValueError(f"speculative_config method {config.method!r} is not implemented yet")
