"""The MTP proposer's bookkeeping pinned to exact values (issue 49), without a
model: which (position, hidden row, token row) each request contributes in a
step, the h a prompt chunk holds for its next step, the batch's order and
attention metadata, where drafting starts, and the scratch blocks drafts 2 and
beyond are written to. test_mtp.py runs the module itself; these decisions
change no token the target accepts, so only exact values show a mistake."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.spec_decode.mtp import (
    HELD,
    DraftStart,
    MTPProposer,
    SeqRows,
    module_batch,
    mtp_target,
    offsets,
    paged_metadata,
)

CPU = torch.device("cpu")


def item(req_id: str, computed: int, new: int, samples: bool, drafts: int = 0, table=(0, 1)):
    """A ScheduledRequest as the proposer reads it."""
    return SimpleNamespace(
        req_id=req_id,
        num_computed_tokens=computed,
        num_new_tokens=new,
        samples=samples,
        num_drafts=drafts,
        block_table=list(table),
    )


def proposer(k: int = 3, block_size: int = 4, first_scratch: int = 10) -> MTPProposer:
    p = MTPProposer.__new__(MTPProposer)
    p.k, p.block_size, p.held = k, block_size, {}
    p.first_scratch, p.scratch_per_seq = first_scratch, 1
    return p


def test_a_model_without_an_mtp_module_is_refused_by_name() -> None:
    with pytest.raises(
        ValueError, match="^speculative_config method 'mtp' needs a model with an MTP module$"
    ):
        mtp_target(SimpleNamespace(has_mtp=lambda: False))
    model = SimpleNamespace(has_mtp=lambda: True)
    assert mtp_target(model) is model


def test_metadata_for_rows_that_end_their_context() -> None:
    meta = paged_metadata([[5], [0, 1, 2]], [[3, 1], [2]], block_size=4, device=CPU)
    assert meta.slot_mapping.tolist() == [1 * 4 + 1, 2 * 4 + 0, 9, 10]
    assert meta.block_tables.tolist() == [[3, 1], [2, -1]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert meta.context_lens.tolist() == [6, 3] and meta.context_lens_cpu == [6, 3]
    assert meta.query_lens_cpu == [1, 3] and meta.cu_seqlens_q.tolist() == [0, 1, 4]
    assert meta.num_decodes == 1
    assert paged_metadata([[3], [7]], [[0], [0, 1]], 4, CPU).num_decodes == 2
    assert paged_metadata([[0, 1], [7]], [[0], [0, 1]], 4, CPU).num_decodes == 0


def test_offsets_count_inputs_and_samples() -> None:
    items = [item("a", 0, 5, False), item("b", 9, 3, True, drafts=2), item("c", 4, 1, True)]
    assert [(i.req_id, o, f) for i, o, f in offsets(items)] == [
        ("a", 0, 0),
        ("b", 5, 0),
        ("c", 8, 3),  # b sampled its token and one after each of its 2 drafts
    ]


def test_a_prompt_chunk_that_samples_nothing_rows_all_but_its_last_position() -> None:
    p = proposer()
    seq = p._rows(item("a", 4, 3, False), offset=2, first=20)
    assert (seq.positions, seq.hidden_rows, seq.token_rows) == ([4, 5], [2, 3], [3, 4])
    assert seq.draft_row is None and seq.held is None


def test_a_sampling_request_rows_each_sampled_token_and_starts_drafting_before_its_drafts() -> None:
    p = proposer()
    # Computed 6; this step: 2 more tokens then 2 drafts, at positions 6..9, inputs at 10..13.
    seq = p._rows(item("b", 6, 4, True, drafts=2), offset=10, first=30)
    assert seq.positions == [6, 7, 8, 9]
    assert seq.hidden_rows == [10, 11, 12, 13]
    assert seq.token_rows == [11, 30, 31, 32]  # the next input, then the tokens sampled
    assert seq.draft_row == 1  # position 7, the last real token


def test_a_held_h_leads_its_requests_rows_only_right_before_them() -> None:
    p = proposer()
    h = torch.ones(1, 4)
    p.held["a"] = (3, h)
    seq = p._rows(item("a", 4, 1, True), offset=0, first=7)
    assert (seq.positions, seq.hidden_rows, seq.token_rows) == ([3, 4], [HELD, 0], [0, 7])
    assert seq.held is h and seq.draft_row == 1 and "a" not in p.held
    p.held["a"] = (2, h)  # not the position before this step's first: dropped
    seq = p._rows(item("a", 4, 1, True), offset=0, first=7)
    assert seq.positions == [4] and seq.held is None and p.held == {}


def test_a_chunks_last_h_is_held_for_its_next_step() -> None:
    p = proposer()
    hidden = torch.arange(8.0).view(8, 1)
    items = [
        item("a", 0, 3, False),
        item("b", 5, 2, True),
        item("c", 10, 3, False),
        item("d", 0, 0, False),
    ]
    p._hold(items, hidden)
    assert sorted(p.held) == ["a", "c"]
    assert p.held["a"][0] == 2 and p.held["a"][1].tolist() == [[2.0]]
    assert p.held["c"][0] == 12 and p.held["c"][1].tolist() == [[7.0]]
    hidden[2] = -1.0
    assert p.held["a"][1].tolist() == [[2.0]]  # a copy
    p.forget(["a", "never"])
    assert sorted(p.held) == ["c"]


def test_a_batch_puts_one_row_requests_first_and_held_rows_after_the_steps() -> None:
    h0, h1 = torch.zeros(1, 2), torch.ones(1, 2)
    long = SeqRows("long", [5, 6], [3, 4, 5], [HELD, 0, 1], [0, 1, 20], held=h0, draft_row=2)
    empty = SeqRows("empty", [9])
    one = SeqRows("one", [7, 8, 9], [8], [HELD], [2], held=h1, draft_row=0)
    batch = module_batch([long, empty, one], num_hidden=4, block_size=4, device=CPU)
    assert batch.positions == [8, 3, 4, 5]
    assert batch.hidden_rows == [4, 5, 0, 1]  # past the step's 4 rows: the held ones, in order
    assert batch.held == [h1, h0] and batch.token_rows == [2, 0, 1, 20]
    assert batch.meta.num_decodes == 1 and batch.meta.query_lens_cpu == [1, 3]
    assert batch.starts == [DraftStart(1 + 2, 5, [5, 6]), DraftStart(0, 8, [7, 8, 9])]  # step order
    assert module_batch([empty], 4, 4, CPU) is None


def test_drafts_past_a_requests_blocks_go_to_its_own_scratch_blocks() -> None:
    p = proposer(block_size=4, first_scratch=10)
    p.scratch_per_seq = 2
    assert p._with_scratch([3, 4], last=7, i=0) == [3, 4]  # in its blocks
    assert p._with_scratch([3, 4], last=8, i=0) == [3, 4, 10]
    assert p._with_scratch([3, 4], last=12, i=1) == [3, 4, 12, 13]
    assert p._with_scratch([3], last=0, i=2) == [3]
