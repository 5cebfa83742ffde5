"""The runner's share of speculative decoding pinned to exact values (issue 49),
on fakes of the step: which tokens a token proposer sees, which drafts and q
go back, what the acceptance check compares (drafts padded with -1, the row
sampled before each), and which requests' q reach the rejection sampler, padded
how. test_spec_decode.py and test_drafts.py run the same code in the engine."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.runner.drafting import HiddenDrafts, TokenDrafts, draft_check, pad, sampled_drafts
from engine.sample.sampler import SamplingRow
from engine.sampling_params import SamplingParams
from engine.spec_decode.proposer import Draft

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0.0)


class Recorder:
    """A token proposer that records what it is shown and answers from a table."""

    def __init__(self, drafts: dict[str, Draft]) -> None:
        self.drafts, self.shown, self.forgotten = drafts, [], []

    def propose(self, reqs):
        self.shown.append([(r.request_id, list(r.token_ids), r.num_prompt_tokens) for r in reqs])
        return self.drafts

    def forget(self, req_ids) -> None:
        self.forgotten += req_ids


def output(req_ids: list[str], rows: list[list[int]]) -> SimpleNamespace:
    out = SimpleNamespace(req_ids=req_ids, draft_token_ids=None, draft_confidence=None)
    out.token_rows = lambda: [SimpleNamespace(token_ids=r) for r in rows]
    return out


def state(prompt: list[int], seed: int = 3) -> SimpleNamespace:
    return SimpleNamespace(prompt_token_ids=prompt, sampling_params=GREEDY, seed=seed)


def test_a_token_proposer_sees_each_request_grow_and_its_drafts_go_back() -> None:
    q = torch.full((2, 5), 0.2)
    proposer = Recorder({"a": Draft([7, 8], q, (0.9, 0.5)), "b": Draft([4])})
    drafts = TokenDrafts(proposer, {"a": state([1, 2]), "b": state([5], seed=9)})
    assert not drafts.reads_hidden
    out = output(["a", "b"], [[3], [6]])
    drafts.propose(None, out, None)
    assert proposer.shown == [[("a", [1, 2, 3], 2), ("b", [5, 6], 1)]]
    assert drafts.reqs["b"].seed == 9 and drafts.reqs["b"].params is GREEDY
    assert out.draft_token_ids == [[7, 8], [4]] and out.draft_confidence == [(0.9, 0.5), None]
    assert drafts.probs("a") is q and drafts.probs("b") is None
    proposer.drafts = {}  # no draft for a this time: its old q goes
    out = output(["a"], [[9, 10]])
    drafts.propose(None, out, None)
    assert proposer.shown[-1] == [("a", [1, 2, 3, 9, 10], 2)]
    assert out.draft_token_ids == [[]] and drafts.probs("a") is None
    drafts.propose(None, None, None)  # another rank: nothing to do
    assert len(proposer.shown) == 2
    drafts.q["b"] = q
    drafts.forget(["a", "b", "never seen"])
    assert drafts.reqs == {} and drafts.q == {} and proposer.forgotten == ["a", "b", "never seen"]


def test_hidden_drafts_on_one_rank_read_rank_0s_tokens_directly() -> None:
    forgotten: list[str] = []
    module = SimpleNamespace(forget=forgotten.extend)
    drafts = HiddenDrafts(module, expert_parallel_size=1)
    assert drafts.reads_hidden and drafts.probs("a") is None
    tokens, accepted = torch.tensor([1, 2]), torch.tensor([0, 1])
    out = SimpleNamespace(sampled_token_ids=tokens, num_accepted=accepted)
    got = drafts._from_rank0(None, out, CPU)
    assert got[0] is tokens and got[1] is accepted
    drafts.forget(["x"])
    assert forgotten == ["x"]


class Module:
    """An MTP proposer that records what it is handed and answers a marker."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def propose(self, items, input_ids, hidden, sampled, accepted) -> str:
        self.calls.append((items, input_ids, hidden, sampled, accepted))
        return "drafts"


def mtp_step(drafts: list[list[int]] | None) -> SimpleNamespace:
    """Two requests that sample; b carries ``drafts`` (None: no request does)."""
    rows = [[], drafts or []]
    model_input = SimpleNamespace(
        items=["item a", "item b"],
        input_ids=torch.tensor([11, 12, 13]),
        req_ids=["a", "b"],
        num_positions=lambda: [1 + len(d) for d in rows],
    )
    return SimpleNamespace(batch=model_input, drafts=None if drafts is None else "check")


def test_hidden_drafts_hand_the_module_the_step_and_rank_0s_tokens() -> None:
    module, step = Module(), mtp_step([5, 6])
    drafts = HiddenDrafts(module, expert_parallel_size=1)
    hidden = torch.zeros(3, 4)
    tokens, accepted = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    out = SimpleNamespace(sampled_token_ids=tokens, num_accepted=accepted, draft_token_ids=None)
    drafts.propose(step, out, hidden)
    [(items, input_ids, got_hidden, got_tokens, got_accepted)] = module.calls
    assert items is step.batch.items and input_ids is step.batch.input_ids
    assert got_hidden is hidden and got_tokens is tokens and got_accepted is accepted
    assert out.draft_token_ids == "drafts"


class Broadcasts:
    """broadcast_from_rank0 as rank 0 of a group sees it: records what it sends."""

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.sent.append(t)
        return t


def test_rank_0_sends_its_tokens_then_its_accepted_counts(monkeypatch) -> None:
    sent = Broadcasts()
    monkeypatch.setattr("engine.runner.drafting.broadcast_from_rank0", sent)
    module = Module()
    drafts = HiddenDrafts(module, expert_parallel_size=2)
    tokens, accepted = torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2])
    out = SimpleNamespace(sampled_token_ids=tokens, num_accepted=accepted, draft_token_ids=None)
    drafts.propose(mtp_step([5, 6]), out, torch.zeros(3, 4))
    assert [t is x for t, x in zip(sent.sent, (tokens, accepted))] == [True, True]
    assert module.calls[0][3] is tokens and module.calls[0][4] is accepted
    assert out.draft_token_ids == "drafts"
    out = SimpleNamespace(sampled_token_ids=tokens[:2], num_accepted=None, draft_token_ids=None)
    drafts.propose(mtp_step(None), out, torch.zeros(3, 4))  # no drafts: the tokens alone
    assert len(sent.sent) == 3 and sent.sent[2] is out.sampled_token_ids
    assert module.calls[1][4] is None


def test_another_rank_makes_room_for_rank_0s_tokens_on_its_device(monkeypatch) -> None:
    sent = Broadcasts()
    monkeypatch.setattr("engine.runner.drafting.broadcast_from_rank0", sent)
    module = Module()
    drafts = HiddenDrafts(module, expert_parallel_size=4)
    hidden = torch.empty(3, 4, device="meta")  # where the rows must go: not the CPU
    drafts.propose(mtp_step([5, 6]), None, hidden)  # a: 1 position, b: 3; 2 requests
    assert [(tuple(t.shape), t.dtype, t.device.type) for t in sent.sent] == [
        ((4,), torch.int64, "meta"),
        ((2,), torch.int64, "meta"),
    ]
    [(_, _, got_hidden, tokens, accepted)] = module.calls
    assert got_hidden is hidden and tokens is sent.sent[0] and accepted is sent.sent[1]
    drafts.propose(mtp_step(None), None, hidden)  # no drafts: only the 2 tokens come
    assert [tuple(t.shape) for t in sent.sent[2:]] == [(2,)]
    assert module.calls[1][4] is None


def batch(drafts: list[list[int]], positions: list[int], req_ids: list[str]) -> SimpleNamespace:
    return SimpleNamespace(drafts=drafts, num_positions=lambda: positions, req_ids=req_ids)


def rows(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, seed=1, step=i) for i, p in enumerate(params)]


class Qs:
    def __init__(self, qs: dict[str, torch.Tensor]) -> None:
        self.qs = qs

    def probs(self, req_id: str) -> torch.Tensor | None:
        return self.qs.get(req_id)


def test_no_drafts_no_check() -> None:
    step = batch([[], []], [1, 1], ["a", "b"])
    assert draft_check(step, rows([GREEDY, GREEDY]), Qs({}), 8, CPU) is None
    assert draft_check(batch([], [], []), [], Qs({}), 8, CPU) is None  # nobody samples


def test_the_check_pads_drafts_and_points_each_at_the_row_sampled_before_it() -> None:
    # a: 1 position, no drafts; b: 3 drafts over 4 positions; c: 1 draft over 2.
    step = batch([[], [5, 6, 7], [4]], [1, 4, 2], ["a", "b", "c"])
    check = draft_check(step, rows([GREEDY] * 7), Qs({}), 8, CPU)
    assert check.drafts.tolist() == [[-1, -1, -1], [5, 6, 7], [4, -1, -1]]
    assert check.rows.tolist() == [[0, 0, 0], [1, 2, 3], [5, 6, 6]]
    assert check.drafts.dtype == check.rows.dtype == torch.int64
    assert check.sampled is None  # nobody drew with a q


def test_only_drawing_requests_with_a_q_reach_the_rejection_sampler() -> None:
    q_b = torch.arange(3 * 4, dtype=torch.float64).view(3, 4) / 100
    q_c = torch.ones(2, 4) / 4
    step = batch([[1, 2], [3, 0, 2], [1], []], [3, 4, 2, 1], ["a", "b", "c", "d"])
    temps = [0.5, 0.25, 0.125, 1.0, 2.0, 4.0, 0.5]  # b's four rows, c's two, d's
    params = [GREEDY] * 3 + [SamplingParams(temperature=t) for t in temps]
    check = draft_check(step, rows(params), Qs({"a": q_b, "b": q_b, "c": q_c}), 4, CPU)
    s = check.sampled
    assert s.index.tolist() == [1, 2]  # a is greedy, d has no q
    assert s.rows.tolist() == [[3, 4, 5], [7, 8, 8]]
    assert s.drafts.tolist() == [[3, 0, 2], [1, 0, 0]]
    assert s.num_drafts.tolist() == [3, 1]
    assert s.probs.dtype == torch.float32 and s.probs.shape == (2, 3, 4)
    assert torch.equal(s.probs[0], q_b.float())
    assert torch.equal(s.probs[1, 0], q_c[0]) and not s.probs[1, 1:].any()
    assert s.filters.temperature.tolist() == [0.5, 0.25, 0.125, 2.0, 4.0, 4.0]  # row by row
    one = batch([[2], [], [3]], [2, 1, 2], ["b", "d", "c"])  # one draft at most: width 1
    narrow = draft_check(one, rows(params[3:8]), Qs({"b": q_b, "c": q_c}), 4, CPU).sampled
    assert narrow.index.tolist() == [0, 2] and narrow.rows.tolist() == [[0], [3]]
    assert narrow.num_drafts.tolist() == [1, 1] and torch.equal(narrow.probs[1, 0], q_c[0])
    meta = torch.device("meta")  # the q go where the rejection sampler runs
    on_meta = draft_check(step, rows(params), Qs({"b": q_b, "c": q_c}), 4, meta).sampled
    assert on_meta.probs.device == meta and on_meta.probs.shape == (2, 3, 4)
    width = len(check.rows[0])
    assert sampled_drafts(step, rows(params), [[0] * width] * 4, Qs({}), 4, CPU) is None


def test_pad() -> None:
    assert pad([4, 5], 4) == [4, 5, 0, 0] and pad([4], 1) == [4] and pad([], 2) == [0, 0]
