"""Future tokens: where step N+1 finds, on the device, the tokens that step N
samples, so that building step N+1 never waits for step N (async scheduling).

The scheduler writes a PLACEHOLDER where a token is still to come. Each running
request owns a slot in a small device buffer, and the model runner replaces
the request's placeholder with a reference to that slot: the negative id
-1 - slot (SGLang's future map also marks a future token by a negative id,
-i for its slot i counted from 1). After sampling, step N writes each
request's token into its slot; before the embedding, step N+1 swaps each
reference for what its slot holds. Both happen on the device, in step order,
so the host never waits.
"""

from __future__ import annotations

import torch


class FutureTokens:
    def __init__(self, num_slots: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_slots, dtype=torch.int64, device=device)
        self.free_slots = list(reversed(range(num_slots)))  # pop() hands out 0 first
        self.slots: dict[str, int] = {}  # request id -> its slot

    def slot(self, req_id: str) -> int:
        """The request's slot; it gets one the first time it is asked for."""
        if req_id not in self.slots:
            if not self.free_slots:
                raise RuntimeError("more running requests than future-token slots")
            self.slots[req_id] = self.free_slots.pop()
        return self.slots[req_id]

    def release(self, req_id: str) -> None:
        """A request that finished or was preempted gives its slot back. A step
        still in flight may yet write the slot, but steps write in order, and the
        next owner reads it only after its own first token has overwritten it."""
        slot = self.slots.pop(req_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    @staticmethod
    def reference(slot: int) -> int:
        """The token id that stands for whatever ``slot`` holds when the step runs."""
        return -1 - slot

    # --8<-- [start:future_resolve]
    def resolve(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Every reference swapped for the token its slot holds, on the device."""
        slots = (-1 - input_ids).clamp_(min=0)
        return torch.where(input_ids < 0, self.tokens[slots], input_ids)

    def store(self, slots: torch.Tensor, sampled: torch.Tensor) -> None:
        """Each sampled token into its request's slot, for the next step to read."""
        self.tokens[slots] = sampled

    # --8<-- [end:future_resolve]
