"""The draft model's own paged KV cache bookkeeping: which of a request's
tokens the draft has keys and values for, in which of its blocks.

The draft runs beside the target on the same requests, one step ahead of what
the target has verified. Each time it proposes, it writes keys and values for
its own guesses; the target then keeps some of them and rejects the rest. So
before the next proposal the draft's cache is rolled back to the longest prefix
it shares with what the request really holds: the tokens it wrote that turned
out right stay, and everything after the first wrong one is recomputed over
(and the blocks past it given back). The cache never shares blocks between
requests (no prefix caching), so a rollback touches nobody else."""

from __future__ import annotations

from engine.kv.block_manager import BlockManager
from engine.sequence import Sequence
from engine.spec_decode.proposer import DraftRequest


class DraftKV:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.shadows: dict[str, Sequence] = {}  # by request id: the tokens written, and blocks

    def catch_up(self, seq: DraftRequest, num_drafts: int, busy: set[str]) -> Sequence | None:
        """The draft's shadow of ``seq``, rolled back to the tokens it got right
        and then given seq's tokens since, with blocks for them and for the
        ``num_drafts - 1`` guesses it will write after them (the last guess is
        only sampled, never fed back). None if the draft's cache has no room
        even after giving back the blocks of requests not in ``busy``."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, [], seq.params, seq.seed)
            self.shadows[seq.request_id] = shadow
        keep = common_prefix(shadow.token_ids, seq.token_ids, shadow.num_computed_tokens)
        self.blocks.free_tail(shadow, keep)  # the blocks of wrong guesses only
        shadow.token_ids = list(seq.token_ids)
        shadow.num_computed_tokens = keep
        if not self._allocate(shadow, seq.num_tokens + num_drafts - 1, busy):
            self.forget([seq.request_id])
            return None
        return shadow

    def _allocate(self, shadow: Sequence, num_tokens: int, busy: set[str]) -> bool:
        """Blocks for ``num_tokens`` slots; when none are left, first give back the
        blocks of requests that are not proposing now (finished or preempted ones
        the scheduler has not reported yet; they recompute if they come back)."""
        if self.blocks.allocate(shadow, num_tokens):
            return True
        idle = [req_id for req_id in self.shadows if req_id not in busy]
        self.forget(idle)
        return self.blocks.allocate(shadow, num_tokens)

    def wrote(self, shadow: Sequence, token_id: int) -> None:
        """The draft feeds one of its guesses at the shadow's end: its keys and
        values go into the draft's cache, to be kept only if it was right."""
        shadow.token_ids.append(token_id)
        shadow.num_computed_tokens = shadow.num_tokens

    def forget(self, req_ids: list[str]) -> None:
        """Give back the blocks of requests that ended (or that must make room)."""
        for req_id in req_ids:
            if (shadow := self.shadows.pop(req_id, None)) is not None:
                self.blocks.free(shadow)


def common_prefix(written: list[int], actual: list[int], limit: int) -> int:
    """How many leading tokens the draft wrote (of its first ``limit``) the
    request really has, short of the request's newest token, which the draft
    always feeds again to get the logits for its first guess."""
    n = min(limit, len(written), len(actual) - 1)
    for i in range(n):
        if written[i] != actual[i]:
            return i
    return n
