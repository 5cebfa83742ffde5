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

from engine.attention.context import get_forward_context
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
    items.append(item("d", 7, 1, True))
    assert [(i.req_id, o, f) for i, o, f in offsets(items)] == [
        ("a", 0, 0),
        ("b", 5, 0),
        ("c", 8, 3),  # b sampled its token and one after each of its 2 drafts
        ("d", 9, 4),  # and c one
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


# ------------------------------------------------ the proposer on a fake module

VOCAB = 97


class Layer:
    """An MTP attention layer as the proposer sizes it: what it asked for, and
    what it held when the larger cache was allocated."""

    def __init__(self) -> None:
        self.kv_cache, self.asked = "the pool's", []

    def kv_cache_spec(self, dtype: torch.dtype) -> SimpleNamespace:
        def allocate(num_blocks: int, block_size: int, device: torch.device):
            self.asked.append((dtype, num_blocks, block_size, device, self.kv_cache))
            tensors = [torch.full((num_blocks, 2), 7.0), torch.full((num_blocks, 3), 7.0)]
            return SimpleNamespace(tensors=lambda: tensors)

        return SimpleNamespace(allocate=allocate)


class Module:
    """The target's MTP module, exact: a row's state is h + its token, its logits
    one-hot at (state + position) mod VOCAB, so each draft names its inputs.
    Each run is recorded with the forward context it ran in."""

    def __init__(self, layers: list[Layer] = ()) -> None:
        self.layers, self.runs, self.weight = list(layers), [], torch.zeros(1)
        self.backends: list[Backend] = []  # the backend each run's attention would use

    def parameters(self):
        yield self.weight

    def mtp_attention_layers(self) -> list[Layer]:
        return self.layers

    def mtp_hidden_states(self, positions, h, tokens):
        ctx = get_forward_context()
        run = (positions.tolist(), h[:, 0].tolist(), tokens.tolist(), ctx.meta, ctx.attn_metadata)
        self.runs.append(run)
        self.backends.append(ctx.backend)
        state = h + tokens[:, None]
        return state + positions[:, None], state

    def draft_logits(self, normed: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.one_hot(normed[:, 0].long() % VOCAB, VOCAB).float()


class Backend:
    def build_metadata(self, meta):
        return ("built", meta)


def pool(num_blocks: int = 10, touched: int = 3, max_model_len: int = 9) -> SimpleNamespace:
    return SimpleNamespace(
        block_size=4,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        num_touched_blocks=touched,
        config=SimpleNamespace(dtype=torch.float16),
    )


def test_the_proposer_adds_zeroed_scratch_blocks_for_chained_drafts() -> None:
    layers = [Layer(), Layer()]
    p = MTPProposer(Module(layers), pool(), Backend(), k=4, max_num_seqs=2)
    assert (p.k, p.block_size, p.max_model_len, p.device) == (4, 4, 9, CPU)
    assert (p.first_scratch, p.scratch_per_seq, p.held) == (10, 1, {})  # 3 drafts: 1 block of 4
    for layer in layers:  # 10 blocks and 2 requests' scratch; the old cache freed first
        assert layer.asked == [(torch.float16, 12, 4, CPU, None)]
        for t in layer.kv_cache.tensors():  # touched and scratch blocks zeroed, others not yet
            assert t[:, 0].tolist() == [0.0] * 3 + [7.0] * 7 + [0.0] * 2
    assert MTPProposer(Module(), pool(), Backend(), k=5, max_num_seqs=1).scratch_per_seq == 1
    assert MTPProposer(Module(), pool(), Backend(), k=6, max_num_seqs=1).scratch_per_seq == 2
    untouched = Layer()  # one draft: no chain, no scratch, the pool's cache kept
    p = MTPProposer(Module([untouched]), pool(), Backend(), k=1, max_num_seqs=2)
    assert p.scratch_per_seq == 0 and untouched.asked == [] and untouched.kv_cache == "the pool's"


def test_drafts_chain_from_each_requests_last_accepted_row() -> None:
    module, backend = Module(), Backend()
    p = MTPProposer(module, pool(max_model_len=9), backend, k=4, max_num_seqs=2)
    # a: a prompt chunk of 3; b: 2 tokens + 2 drafts at 5..7; c: a decode at 2.
    items = [
        item("a", 0, 3, False, table=[40]),
        item("b", 5, 3, True, drafts=2, table=[20, 21]),
        item("c", 2, 1, True, table=[30]),
    ]
    hidden = torch.arange(7.0).view(7, 1) * 10  # row r's h: 10 r
    input_ids = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    sampled = torch.tensor([8, 9, 11, 12])  # b's 3 (rows 7..9 of inputs + samples), c's 1
    drafts = p.propose(items, input_ids, hidden, sampled, torch.tensor([1, 0]))
    assert drafts.dtype == torch.int64
    assert drafts.tolist() == [[55, 14, 29, 58], [74, 52, 8, 17]]  # b's, then c's
    main, *chain = module.runs
    # c (one row) first, then a's two rows (its last waits), then b's three.
    assert main[:3] == ([2, 0, 1, 5, 6, 7], [60, 0, 10, 30, 40, 50], [12, 2, 3, 8, 9, 11])
    assert main[3].block_tables.tolist() == [[30, -1], [40, -1], [20, 21]]
    assert main[3].slot_mapping.tolist() == [122, 160, 161, 85, 86, 87]
    assert main[4] == ("built", main[3])
    assert len(module.backends) == 4 and all(b is backend for b in module.backends)
    # b accepted 1 draft: it drafts on from position 7, c from 3; b's h is row 4's state
    # (40 + 9), c's row 0's (60 + 12). Position 9 is past max_model_len - 1 = 8: held at 8.
    assert [run[:3] for run in chain] == [
        ([7, 3], [49, 72], [55, 74]),
        ([8, 4], [104, 146], [14, 52]),
        ([8, 5], [118, 198], [29, 8]),
    ]
    for run in chain:  # b's third block and c's second are their scratch blocks, 10 and 11
        assert run[3].block_tables.tolist() == [[20, 21, 10], [30, 11, -1]]
    assert [run[3].slot_mapping.tolist() for run in chain] == [[87, 123], [40, 44], [40, 45]]
    assert [run[3].context_lens_cpu for run in chain] == [[8, 4], [9, 5], [9, 6]]
    assert p.held["a"][0] == 2 and p.held["a"][1].tolist() == [[20.0]]
    # a's next step: its held h (position 2) with this step's input, then its sample.
    module.runs.clear()
    step = [item("a", 3, 1, True, table=[40])]
    drafts = p.propose(step, torch.tensor([5]), torch.tensor([[100.0]]), torch.tensor([6]), None)
    assert drafts.tolist() == [[12, 25, 51, 6]] and p.held == {}
    assert module.runs[0][:3] == ([2, 3], [20, 100], [5, 6])
    assert [run[0] for run in module.runs[1:]] == [[4], [5], [6]]
    assert module.runs[1][3].block_tables.tolist() == [[40, 10]]


def test_one_draft_runs_the_module_once_and_no_rows_nothing() -> None:
    module = Module()
    p = MTPProposer(module, pool(), Backend(), k=1, max_num_seqs=2)
    items = [item("b", 5, 1, True, table=[20, 21]), item("c", 2, 1, True, table=[30])]
    hidden, ids = torch.tensor([[10.0], [20.0]]), torch.tensor([1, 2])
    drafts = p.propose(items, ids, hidden, torch.tensor([3, 4]), None)
    assert drafts.tolist() == [[10 + 3 + 5], [20 + 4 + 2]] and len(module.runs) == 1
    # A prompt chunk alone: its rows are written, nobody drafts.
    chunk = [item("a", 0, 3, False, table=[40])]
    hidden = torch.zeros(3, 1)
    drafts = p.propose(
        chunk, torch.tensor([1, 2, 3]), hidden, torch.tensor([], dtype=torch.int64), None
    )
    assert drafts.shape == (0, 1) and drafts.dtype == torch.int64 and len(module.runs) == 2
    # A one-token chunk: no rows at all (its h is held), the module does not run.
    p.held.clear()
    one = [item("a", 0, 1, False, table=[40])]
    drafts = p.propose(
        one, torch.tensor([1]), torch.zeros(1, 1), torch.tensor([], dtype=torch.int64), None
    )
    assert drafts.shape == (0, 1) and drafts.dtype == torch.int64 and len(module.runs) == 2
    assert list(p.held) == ["a"]


def test_a_chained_draft_gets_a_scratch_block_exactly_when_it_starts_a_block() -> None:
    module = Module()
    p = MTPProposer(module, pool(), Backend(), k=2, max_num_seqs=2)
    # d's draft 2 lands at position 3, the end of its block; e's at 4, past its blocks.
    items = [item("d", 2, 1, True, table=[30]), item("e", 3, 1, True, table=[31])]
    hidden, ids = torch.tensor([[10.0], [20.0]]), torch.tensor([1, 2])
    drafts = p.propose(items, ids, hidden, torch.tensor([3, 4]), None)
    assert drafts.tolist() == [[15, 31], [27, 55]]
    chained = module.runs[1]
    assert chained[:3] == ([3, 4], [13, 24], [15, 27])
    assert chained[3].block_tables.tolist() == [[30, -1], [31, 11]]  # e's scratch: 10 + 1
    assert chained[3].slot_mapping.tolist() == [123, 44]
