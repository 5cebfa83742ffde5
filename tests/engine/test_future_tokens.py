"""Future tokens: a reference to a slot becomes, on the device, whatever the
slot holds when the step runs; other ids pass through; slots are reused."""

from __future__ import annotations

import pytest
import torch

from engine.runner.future_tokens import FutureTokens


def test_references_resolve_to_what_their_slots_hold_when_the_step_runs() -> None:
    future = FutureTokens(4, torch.device("cpu"))
    a, b = future.slot("a"), future.slot("b")
    assert (a, b) == (0, 1) and future.slot("a") == a  # one slot a request
    ids = torch.tensor([7, future.reference(b), 9, future.reference(a)])
    future.store(torch.tensor([a, b]), torch.tensor([101, 202]))  # step N samples
    assert future.resolve(ids).tolist() == [7, 202, 9, 101]  # step N+1 reads
    future.store(torch.tensor([b]), torch.tensor([303]))  # a later step, only b
    assert future.resolve(ids).tolist() == [7, 303, 9, 101]
    assert ids.tolist()[0] == 7 and ids.tolist()[1] < 0  # the inputs are not changed


def test_a_released_slot_goes_to_the_next_request() -> None:
    future = FutureTokens(2, torch.device("cpu"))
    future.slot("a"), future.slot("b")
    future.release("a")
    future.release("a")  # twice (finished, then preempted): no harm
    assert future.slot("c") == 0
    with pytest.raises(RuntimeError, match="slots"):  # a third running request, in two
        future.slot("d")
