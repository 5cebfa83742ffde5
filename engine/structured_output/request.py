"""One request's place in its grammar."""

from __future__ import annotations

from typing import Any

import torch


class StructuredOutputRequest:
    """An xgrammar matcher that has accepted every token the request generated.

    A row's mask depends on the request's previous token: the matcher must
    have accepted it before it can say what may follow. So a structured request
    cannot have its next step prepared before its last token is known; an
    engine that schedules a step ahead must wait for these requests' tokens
    (see `StructuredOutputManager.requests_needing_tokens`).
    """

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self.compiled = compiled
        self.matcher = xgr.GrammarMatcher(compiled)
        self.num_accepted = 0  # tokens accepted: the request's output tokens so far

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens the grammar allows next into row ``row`` of ``bitmask``."""
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token: int) -> None:
        """Move past a token the mask allowed; any other token is a bug."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} breaks the grammar after {self.num_accepted}")
        self.num_accepted += 1

    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing may follow."""
        return self.matcher.is_terminated()

    def catch_up(self, output_token_ids: list[int]) -> None:
        """Make the matcher's state that of ``output_token_ids``.

        Preemption by recompute keeps a request's tokens, so its matcher stays
        in step. Anything that throws tokens away (a rejected draft, a step
        prepared ahead and dropped) leaves it ahead: it is rebuilt from the
        tokens the request really has.
        """
        if self.num_accepted == len(output_token_ids):
            return
        self.matcher.reset()
        self.num_accepted = 0
        for token in output_token_ids:
            self.accept(token)

    def validate_tokens(self, tokens: list[int]) -> int:
        """How many of ``tokens``, in order, the grammar accepts from here, the
        state left unchanged: speculative decoding's check of a draft."""
        n = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def draft_prefix(self, tokens: list[int]) -> int:
        """How many of a draft's ``tokens``, in order, the grammar accepts from
        here without completing, the state left unchanged: the drafts a verify
        step may check (the token that completes the grammar the model samples
        itself, since no mask follows a complete grammar)."""
        n = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            n += 1
            if self.matcher.is_terminated():
                self.matcher.rollback(1)
                n -= 1
                break
        if n:
            self.matcher.rollback(n)
        return n

    def fill_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows ``row``, ``row + 1``, ...: the tokens allowed next, then after each
        draft in turn (every one of them a prefix draft_prefix accepted), the
        state left unchanged. Each verified position is masked as if the drafts
        before it were accepted, which is the only case its token is kept in."""
        self.fill_bitmask(bitmask, row)
        for i, token in enumerate(drafts):
            if not self.matcher.accept_token(token):
                raise RuntimeError(f"draft token {token} breaks the grammar")
            self.fill_bitmask(bitmask, row + 1 + i)
        if drafts:
            self.matcher.rollback(len(drafts))
