"""What one engine hands another when a request moves between them (Chapter 8):
a prefill worker to a decode worker, or a router resuming a stream whose decode
worker died.

The request's blocks travel through the store, filed by their hash chain; the
handoff carries only what the store cannot know: the tokens generated so far,
how many of them the client has already seen, and the sender's chain over the
prompt's full blocks, which the receiver checks against its own. A different
model, KV format or block size gives a different chain root, so a mismatch is
caught before a single wrong block is read.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Handoff:
    output_token_ids: list[int]  # generated so far, by the sender
    num_sent_tokens: int = 0  # of those, how many the client has seen as text
    block_hashes: list[bytes] = field(default_factory=list)  # the sender's chain

    def __post_init__(self) -> None:
        if not 0 <= self.num_sent_tokens <= len(self.output_token_ids):
            raise ValueError(
                f"num_sent_tokens {self.num_sent_tokens} must be between 0 and the "
                f"{len(self.output_token_ids)} output tokens handed on"
            )
