"""What the scheduler notes as it goes: each request's events (queued, scheduled,
preempted), which the front end turns into its timings, and each step's counts
of prefill and decode tokens, in the engine's stats."""

from __future__ import annotations

import time
from collections.abc import Mapping
from itertools import count

from engine.attention.metadata import decode_query_len
from engine.outputs import EngineCoreEvent, EngineCoreEventType
from engine.scheduler_output import SchedulerOutput
from engine.sequence import Sequence
from engine.stats import EngineStats


class EventLog:
    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats
        self._index = count()

    def record(self, seq: Sequence, kind: EngineCoreEventType, num_cached: int = 0) -> None:
        """Note what happened to ``seq``, in this step, after everything noted before."""
        step = self.stats.steps + 1  # the step being scheduled (counted once it is)
        index, now = next(self._index), time.perf_counter()
        seq.events.append(EngineCoreEvent(index, kind, step, seq.num_tokens, now, num_cached))


def count_step(stats: EngineStats, out: SchedulerOutput, requests: Mapping[str, Sequence]) -> None:
    """A scheduled step's tokens, as decodes or as prefill; one more step if it runs."""
    for item in out.scheduled:
        seq = requests[item.req_id]
        decode = item.num_new_tokens == decode_query_len(item.num_drafts)
        if decode and seq.num_output_tokens > 0 and item.samples:
            stats.decode_tokens += item.num_new_tokens
        else:
            stats.prefill_tokens += item.num_new_tokens
            stats.partial_prefills += not item.samples
    stats.steps += bool(out.scheduled)  # a step is a forward pass
