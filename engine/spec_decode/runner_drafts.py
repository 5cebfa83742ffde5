"""The scheduler's side of a proposer that runs in the model runner (MTP).

A proposer that needs the target's hidden states drafts in the model runner,
after the step's forward pass (mtp.py), and its drafts come back with the
step's tokens in ModelRunnerOutput. update_from_output keeps each request's on
its Sequence, and at the next step this proposer hands them to the scheduler
like any proposer's, where they are still the guesses after the sequence's
newest token: the scheduler asks only for sequences that decode one token, and
a sequence whose newest token came after the drafts (it was preempted and
recomputed, say) gets none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.spec_decode.proposer import Draft

if TYPE_CHECKING:
    from engine.sequence import Sequence


class RunnerDrafts:
    """A DraftProposer whose drafts the model runner made and the sequences keep."""

    def propose(self, seqs: list[Sequence]) -> dict[str, Draft]:
        """The kept drafts of each of ``seqs`` that were made after its newest token."""
        return {
            seq.request_id: Draft(seq.runner_drafts)
            for seq in seqs
            if seq.runner_drafts and seq.runner_drafts_at == seq.num_tokens
        }

    def forget(self, req_ids: list[str]) -> None:
        """Nothing to forget here: the drafts end with their sequences."""
