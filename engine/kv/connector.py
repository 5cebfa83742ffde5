"""The scheduler's seam to an outside source of cached blocks: a KV connector.

Chapter 8 splits prefill and decode across engines, which move KV blocks through
a store. The scheduler does not know the store; it asks a connector three
things, at three moments of a request's life:

- when it admits the request: how many tokens past the local prefix cache's
  hits does the outside source hold, and do they load in the background?
- once it has allocated blocks for those tokens: which blocks they are, so that
  the connector's worker side can fill them;
- when the request finishes: must its blocks stay held until they are saved?

and, at the start of every step, which background loads have finished.

A load in the background keeps its request in WAITING_FOR_KV, scheduled for
nothing, until ``Scheduler.kv_loaded`` reports it done; a save keeps the
finished request's blocks until ``Scheduler.finish_saving`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.sequence import Sequence


class KVConnector(Protocol):
    """The scheduler's side of a connector (its worker side moves the bytes)."""

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        """How many tokens after the first ``num_computed_tokens`` (the local
        prefix cache's hits) the outside source holds for ``seq``, and whether
        they load asynchronously. A whole number of blocks, never reaching the
        request's last token: the model must still run on that one."""
        ...

    def after_allocation(
        self, seq: Sequence, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The blocks the scheduler allocated for those tokens, in order (only
        called when there are some): the worker side loads the tokens into them."""
        ...

    def finished_loads(self) -> dict[str, int]:
        """Background loads done since the last call, their blocks filled: the
        tokens each loaded, by request id (fewer than offered if a block failed
        its check). The scheduler asks at the start of every step."""
        ...

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        """``seq`` has finished, holding ``block_ids``. True: keep them until the
        connector has saved them (``Scheduler.finish_saving``); False: free them."""
        ...


class NoConnector:
    """The default: no outside source, so every request computes what the local
    prefix cache does not hold, and finished requests free their blocks at once."""

    def num_external_tokens(self, seq: Sequence, num_computed_tokens: int) -> tuple[int, bool]:
        return 0, False

    def after_allocation(
        self, seq: Sequence, block_ids: list[int], num_external_tokens: int
    ) -> None:
        pass

    def finished_loads(self) -> dict[str, int]:
        return {}

    def request_finished(self, seq: Sequence, block_ids: list[int]) -> bool:
        return False
