"""The scheduler's hook for a KV connector (kv/connector.py): the requests whose
blocks an outside source is filling, and the finished ones whose blocks it is
still saving, with the checks on what the connector offers.

A load in the background keeps its request in WAITING_FOR_KV, holding its
blocks and scheduled for nothing, until the connector reports it done
(Scheduler.kv_loaded); a save keeps a finished request's blocks until the
connector reports it saved (Scheduler.finish_saving). Without a store the
connector is NoConnector, which offers nothing and saves nothing."""

from __future__ import annotations

from collections.abc import Collection, Mapping

from engine.kv.connector import KVConnector, NoConnector
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus


class ConnectorHook:
    def __init__(self, connector: KVConnector | None, block_size: int) -> None:
        self.connector: KVConnector = connector or NoConnector()
        self.block_size = block_size
        # By request id: loads in flight (with the tokens computed once they are
        # done), and the finished requests whose blocks the connector still saves.
        self.loading: dict[str, tuple[Sequence, int]] = {}
        self.saving: dict[str, Sequence] = {}

    def holds(self, req_id: str) -> bool:
        """Does the connector still fill or read this request's blocks?"""
        return req_id in self.loading or req_id in self.saving

    def num_external_tokens(self, seq: Sequence, num_cached: int) -> tuple[int, bool]:
        """The connector's tokens for ``seq`` past its ``num_cached`` cached ones,
        checked: whole blocks, short of the last token, which the model must run.
        Nothing for a request that asks for prompt logprobs: the model runs them all."""
        if seq.params.prompt_logprobs is not None:
            return 0, False
        num_external, load_async = self.connector.num_external_tokens(seq, num_cached)
        end = num_cached + num_external
        if num_external < 0 or num_external % self.block_size or end >= seq.num_tokens:
            raise ValueError(
                f"the connector offers tokens {num_cached}..{end} of {seq.request_id!r}, "
                f"which has {seq.num_tokens}: whole blocks before the last token only"
            )
        return num_external, load_async and num_external > 0

    def load(self, seq: Sequence, num_external: int, load_async: bool) -> None:
        """Tell the connector which blocks were allocated for its tokens, so that
        its worker side fills them: before this step's forward pass (the tokens
        count as computed now), or in the background, while ``seq`` waits in
        WAITING_FOR_KV, holding its blocks, until the load is reported done."""
        if num_external == 0:
            return
        first = seq.num_computed_tokens // self.block_size  # the blocks after the cached ones
        block_ids = seq.block_table[first : first + num_external // self.block_size]
        self.connector.after_allocation(seq, block_ids, num_external)
        if load_async:
            seq.status = SequenceStatus.WAITING_FOR_KV
            self.loading[seq.request_id] = (seq, seq.num_computed_tokens + num_external)
        else:
            seq.num_computed_tokens += num_external

    def loaded(self, req_ids: Collection[str] | Mapping[str, int]) -> list[tuple[Sequence, int]]:
        """The requests whose loads are done, each with its tokens computed now.
        A mapping gives the tokens each loaded, when fewer than offered (a block
        that failed its check): the rest are computed."""
        done = []
        for req_id in req_ids:
            if req_id not in self.loading:
                continue  # not loading, or reported twice
            seq, num_loaded = self.loading.pop(req_id)
            if isinstance(req_ids, Mapping):
                num_loaded = min(num_loaded, seq.num_computed_tokens + req_ids[req_id])
            done.append((seq, num_loaded))
        return done

    def finished(self, seq: Sequence) -> None:
        """``seq`` has finished: keep its blocks while the connector saves them."""
        if self.connector.request_finished(seq, list(seq.block_table)):
            self.saving[seq.request_id] = seq

    def saved(self, req_ids: Collection[str]) -> list[Sequence]:
        """The finished requests whose blocks are saved now, to be freed."""
        return [seq for r in req_ids if (seq := self.saving.pop(r, None)) is not None]


def hand_on(out: SchedulerOutput, held: SchedulerOutput) -> SchedulerOutput:
    """An output that schedules nothing (every request left waits for its KV)
    runs no step, so the model runner never reads it: its new requests and its
    preempted and finished ids go with the next output that does. ``held``:
    what earlier outputs held back; returns what this one holds back."""
    out.new_requests[:0] = held.new_requests
    out.preempted_req_ids[:0] = held.preempted_req_ids
    out.finished_req_ids[:0] = held.finished_req_ids
    if out.scheduled:
        return SchedulerOutput()
    kept = SchedulerOutput(
        new_requests=out.new_requests,
        preempted_req_ids=out.preempted_req_ids,
        finished_req_ids=out.finished_req_ids,
    )
    out.new_requests, out.preempted_req_ids, out.finished_req_ids = [], [], []
    return kept
