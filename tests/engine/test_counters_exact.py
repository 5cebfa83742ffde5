"""The engine's counts and the decisions that change no token, each pinned to
its exact value on a constructed case, so that an off-by-one fails: drafts
chosen, accepted and rejected (SpecDecodeStats, sched/drafts.py), the cut of
drafts to the budget, max_tokens and the model's length, a prompt exactly at
the context limit, the seeds a request checker gives, and the timeouts the
read clocks arm. The end-to-end tests check that these numbers agree with one
another; these check the numbers themselves."""

from __future__ import annotations

import asyncio
import json

import pytest
from tokenizers import Tokenizer
from uvicorn.protocols.http.h11_impl import H11Protocol

from engine import LLM, SamplingParams
from engine.core.request_checker import BlockChain, RequestChecker
from engine.entrypoints import read_timeouts
from engine.entrypoints.read_timeouts import BodyTimedOut, BodyTimeout, HeadTimeoutProtocol
from engine.kv.block_manager import HOLE, BlockManager
from engine.kv.handoff import Handoff
from engine.kv.store_connector import block_chain
from engine.outputs import FinishReason
from engine.sampling_params import StructuredOutputsParams
from engine.sched.drafts import cut_drafts, proposed
from engine.sequence import Sequence
from engine.spec_decode import Draft
from engine.spec_decode.verify_length import StepShape
from engine.stats import SpecDecodeStats
from engine.structured_output import StructuredOutputManager
from tests.engine.test_drafts import fold, scheduler
from tests.server.conftest import TINY

# ------------------------------------------------------------ speculative decoding


def test_verify_steps_count_chosen_accepted_and_rejected_drafts_exactly() -> None:
    sched = scheduler()
    seq = Sequence("a", [10, 11, 12], SamplingParams(max_tokens=50))
    sched.add(seq)
    spec = sched.stats.spec_decode
    fold(sched, {"a": [20]}, {"a": [30, 31, 32, 33]})  # the prompt: no drafts yet
    assert (spec.num_drafts, spec.chosen_lengths) == (0, [])
    fold(sched, {"a": [40, 41, 42, 43, 44]}, {"a": [30, 31, 32, 33]})  # all four rejected
    fold(sched, {"a": [30, 31, 50, 51, 52]}, {"a": [60, 61]})  # two accepted, two rejected
    # Short drafts, both accepted: the bonus token after them comes in the same step.
    out, [news] = fold(sched, {"a": [60, 61, 62]}, {})
    assert out.scheduled[0].draft_token_ids == [60, 61]
    assert news.new_token_ids == [60, 61, 62]
    assert seq.num_output_tokens == 1 + 1 + 3 + 3
    assert (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) == (3, 10, 4)
    assert spec.accepted_lengths == [1, 0, 2]  # one step accepted 0, two accepted 2
    assert spec.chosen_lengths == [0, 0, 1, 0, 2]
    rejected = spec.num_draft_tokens - spec.num_accepted_tokens
    assert rejected == 6
    assert sched.stats.generated_tokens == 8
    assert sched.stats.decode_tokens == 5 + 5 + 3
    fold(sched, {"a": [70]})  # no drafts came back: a plain decode, not a verify step
    assert (spec.num_drafts, spec.chosen_lengths) == (3, [0, 0, 1, 0, 2])


def decoding(prompt: int, outputs: int, max_tokens: int = 50) -> Sequence:
    """A running sequence with ``prompt`` + ``outputs`` tokens, all but the newest computed."""
    seq = Sequence("s", list(range(prompt + outputs)), SamplingParams(max_tokens=max_tokens))
    seq.num_prompt_tokens = prompt
    seq.num_computed_tokens = seq.num_tokens - 1
    return seq


FIVE = Draft([1, 2, 3, 4, 5], None, (0.9, 0.8, 0.7, 0.6, 0.5))


@pytest.mark.parametrize(
    "seq,budget,max_model_len",
    [
        (decoding(3, 1), 3, None),  # the budget: one new token and two drafts
        (decoding(3, 1, max_tokens=4), 64, None),  # 1 + 2 drafts + 1 sampled after = 4
        (decoding(3, 1), 64, 7),  # 4 tokens, 2 drafts and the one after them: 7
    ],
    ids=["budget", "max_tokens", "max_model_len"],
)
def test_drafts_are_cut_to_exactly_the_room_left(seq: Sequence, budget: int, max_model_len) -> None:
    stats = SpecDecodeStats()
    kept = cut_drafts(seq, 1, budget, FIVE, max_model_len, stats)
    assert kept.token_ids == [1, 2] and kept.confidence == (0.9, 0.8)
    assert stats.chosen_lengths == [0, 0, 1]


def test_no_room_chooses_zero_drafts_and_stale_drafts_are_not_chosen() -> None:
    stats = SpecDecodeStats()
    assert len(cut_drafts(decoding(3, 1), 1, 1, FIVE, None, stats)) == 0  # budget 1: none
    assert len(cut_drafts(decoding(3, 3, max_tokens=4), 1, 64, FIVE, None, stats)) == 0
    assert len(cut_drafts(decoding(3, 1), 1, 64, FIVE, 5, stats)) == 0  # one token from the end
    assert stats.chosen_lengths == [3]
    behind = decoding(3, 1)
    behind.num_computed_tokens -= 1  # two tokens to compute: not after its newest token
    assert len(cut_drafts(behind, 1, 64, FIVE, None, stats)) == 0
    assert stats.chosen_lengths == [3]  # not a request given drafts this step


# ------------------------------------------------------------ the context limit


def checker(seed: int = 0, max_model_len: int = 8) -> RequestChecker:
    return RequestChecker(None, 100, max_model_len, None, seed)  # type: ignore[arg-type]


def test_a_prompt_one_short_of_the_context_limit_is_taken_and_one_at_it_refused() -> None:
    assert checker().check("a", list(range(7))).num_prompt_tokens == 7
    with pytest.raises(ValueError, match="prompt has 8 tokens, but the maximum model length is 8"):
        checker().check("a", list(range(8)))


def test_a_prompt_at_the_limit_generates_exactly_one_token() -> None:
    sched = scheduler()
    sched.max_model_len = 8
    seq = Sequence("a", list(range(10, 17)), SamplingParams(max_tokens=50))  # 7 tokens
    sched.add(seq)
    _, [news] = fold(sched, {"a": [20]})
    assert news.new_token_ids == [20] and news.finish_reason == FinishReason.LENGTH
    seq = Sequence("b", list(range(10, 16)), SamplingParams(max_tokens=50))  # 6 tokens
    sched.add(seq)
    _, [news] = fold(sched, {"b": [20]})
    assert news.finish_reason is None
    _, [news] = fold(sched, {"b": [21]})
    assert news.finish_reason == FinishReason.LENGTH and seq.num_output_tokens == 2


# ------------------------------------------------------------ seeds


def test_a_request_without_a_seed_gets_the_engines_mixed_with_its_arrival() -> None:
    c = checker(seed=7)
    assert c.check("a", [1, 2]).seed == 7 * 1_000_003
    c.num_added = 2
    assert c.check("b", [1, 2]).seed == 7 * 1_000_003 + 2
    assert c.check("c", [1, 2], SamplingParams(seed=5)).seed == 5
    assert c.check("d", [1, 2], seed=9).seed == 9  # one a front end gave it
    assert c.check("e", [1, 2], SamplingParams(seed=5), seed=9).seed == 5  # its own first
    assert c.check("f", [1, 2], SamplingParams(seed=0)).seed == 0  # 0 is a seed, not none


def test_the_engine_counts_each_request_it_adds_into_the_next_seed() -> None:
    engine = LLM(str(TINY), dtype="float32", num_kv_blocks=16, max_model_len=64, seed=3)
    core = engine.llm_engine
    for rid in ("a", "b", "c"):
        core.add_request(rid, [5, 6, 7])
    assert [core.requests[r].seed for r in "abc"] == [3_000_009, 3_000_010, 3_000_011]
    seq = core.make_sequence("d", [5, 6])  # checked, not added: no count
    assert seq.seed == 3_000_012 and core.make_sequence("e", [5]).seed == 3_000_012


# ------------------------------------------------------------ read timeouts


class Clock:
    """A loop whose call_later is recorded (and never runs: the loop never runs)."""

    def __init__(self) -> None:
        self.calls: list[float] = []
        self.handles: list[asyncio.TimerHandle] = []
        self.loop = asyncio.new_event_loop()

    def call_later(self, delay: float, callback) -> asyncio.TimerHandle:
        self.calls.append(delay)
        self.handles.append(self.loop.call_later(delay, callback))
        return self.handles[-1]


def test_the_head_clock_is_armed_with_exactly_its_timeout() -> None:
    protocol = object.__new__(HeadTimeoutProtocol)
    protocol.head_timeout, protocol.head_timer, protocol.cycle = 2.5, None, None
    protocol.loop = clock = Clock()  # type: ignore[assignment]
    protocol._start_clock()
    protocol._start_clock()  # again on a kept-alive connection: the old one cancelled
    assert clock.calls == [2.5, 2.5]
    assert [h.cancelled() for h in clock.handles] == [True, False]
    clock.loop.close()


def test_the_body_clock_waits_exactly_its_timeout_for_each_piece(monkeypatch) -> None:
    waits: list[float] = []

    async def wait_for(awaitable, timeout: float):
        waits.append(timeout)
        return await awaitable

    monkeypatch.setattr(read_timeouts.asyncio, "wait_for", wait_for)
    pieces = [{"type": "http.request", "body": b"a", "more_body": True},
              {"type": "http.request", "body": b"b", "more_body": False}]  # fmt: skip

    async def receive() -> dict:
        return pieces.pop(0) if pieces else {"type": "http.disconnect"}

    async def app(scope, receive, send) -> None:
        for _ in range(3):  # two pieces of body, then a wait for a disconnect
            await receive()

    asyncio.run(BodyTimeout(app, 1.5)({"type": "http"}, receive, None))  # type: ignore[arg-type]
    assert waits == [1.5, 1.5]  # the third receive waits with no clock
    assert BodyTimedOut(1.5).detail == "the request body paused for more than 1.5 s"


# ------------------------------------------------------------ the window's mark


def test_the_window_marks_the_tokens_computed_at_its_first_give_back_only() -> None:
    bm = BlockManager(16, 4)
    seq = Sequence("w", list(range(40)), SamplingParams())
    assert bm.allocate(seq, 27)
    seq.num_computed_tokens = 20
    bm.cache_full_blocks(seq)  # blocks 0..4 published as they filled
    assert bm.free_outside_window(seq, 4, 8) == 2  # (20 - 8) // 4 = 3: blocks 1, 2
    assert seq.num_unwindowed_tokens == 20
    seq.num_computed_tokens = 27
    assert bm.free_outside_window(seq, 4, 8) == 1  # (27 - 8) // 4 = 4: block 3 too
    assert seq.num_unwindowed_tokens == 20  # the first give-back's count stays
    assert seq.block_table[1:4] == [HOLE] * 3 and HOLE not in seq.block_table[4:]
    assert len(seq.block_hashes) == 5
    bm.cache_full_blocks(seq)  # block 5 (tokens 20..23) was computed after the mark
    assert len(seq.block_hashes) == 5
    assert bm.free_outside_window(seq, 4, 8) == 0
    bm.free(seq)
    assert seq.num_unwindowed_tokens is None and bm.num_free_blocks == 16


# ------------------------------------------------------------ handed-on requests


def handing(max_model_len: int = 16) -> RequestChecker:
    chain = BlockChain(b"r" * 32, 4)
    return RequestChecker(None, 100, max_model_len, None, 0, chain)  # type: ignore[arg-type]


PROMPT = list(range(10, 19))  # 9 tokens: two full blocks of 4
MISMATCH = (
    "^the handed-on block hashes do not match this engine's: the sender serves "
    "another model, KV format or block size, or another prompt$"
)
NO_ROOM = "^the handed-on request has no room left to generate$"


@pytest.mark.parametrize(
    "outputs,blocks,params,why",
    [
        ([5], 3, SamplingParams(), MISMATCH),  # three blocks of a two-block prompt
        (
            [5],
            2,
            SamplingParams(prompt_logprobs=1),
            "^a handed-on request cannot have structured outputs or prompt_logprobs$",
        ),  # fmt: skip
        ([], 2, SamplingParams(), r"output token ids must be integers in \[0, 100\)"),
        ([100], 2, SamplingParams(), r"output token ids must be integers in \[0, 100\)"),
        ([5, 6, 7], 2, SamplingParams(max_tokens=3), NO_ROOM),  # 3 of max_tokens 3
        ([5] * 7, 2, SamplingParams(), NO_ROOM),  # 9 + 7 = 16, the model's length
    ],
)
def test_a_handoff_is_refused_exactly_past_each_limit(outputs, blocks, params, why) -> None:
    c = handing()
    chain = c.store_chain.of(PROMPT, blocks)
    with pytest.raises(ValueError, match=why):
        c.check("a", PROMPT, params, Handoff(outputs, 0, chain))


def test_a_handoff_just_within_the_limits_continues_the_request() -> None:
    c = handing()
    chain = c.store_chain.of(PROMPT, 2)
    assert chain == block_chain(b"r" * 32, PROMPT, 4, 2) and len(chain) == 2
    seq = c.check("a", PROMPT, SamplingParams(max_tokens=7), Handoff([5] * 6, 0, chain))
    assert seq.token_ids == PROMPT + [5] * 6 and seq.num_prompt_tokens == 9  # 15 of 16
    assert seq.handoff is not None and seq.handoff.block_hashes == chain
    assert c.check("b", PROMPT, None, Handoff([99], 0, chain[:1])).num_tokens == 10
    with pytest.raises(ValueError, match="^a handed-on request needs a kv_store to load its blocks from$"):  # fmt: skip
        checker(max_model_len=16).check("c", PROMPT, None, Handoff([5], 0, chain))


# ------------------------------------------------------------ the verify schedule's view


class Shapes:
    """A verify-length schedule that records the step it is shown and keeps one draft."""

    def __init__(self) -> None:
        self.seen: list[tuple[StepShape, list[str]]] = []

    def cut(self, drafts: dict[str, Draft], step: StepShape) -> dict[str, Draft]:
        self.seen.append((step, sorted(drafts)))
        return {r: d.head(1) for r, d in drafts.items()}


def running(rid: str, n: int, computed: int, drafts: list[int], at: int | None = None) -> Sequence:
    seq = Sequence(rid, list(range(n)), SamplingParams())
    seq.num_computed_tokens = computed
    seq.spec_token_ids, seq.spec_at = drafts, n if at is None else at
    return seq


def test_the_schedule_sees_the_steps_tokens_and_sure_outputs_and_fresh_drafts_only() -> None:
    seqs = [
        running("a", 8, 7, [1, 2, 3]),  # decoding, fresh drafts
        running("b", 8, 7, [1, 2], at=7),  # drafts made before its newest token: stale
        running("c", 8, 7, []),  # decoding, no drafts
        running("d", 20, 8, [1]),  # a prefill chunk of 12 to go
    ]
    schedule = Shapes()
    left = lambda s: s.num_tokens - s.num_computed_tokens  # noqa: E731
    got = proposed(seqs, left, schedule, 64)
    assert schedule.seen == [(StepShape(1 + 1 + 1 + 12, 3), ["a"])]
    assert {r: d.token_ids for r, d in got.items()} == {"a": [1]}
    proposed(seqs, left, schedule, 10)  # the budget caps the step's tokens
    assert schedule.seen[-1][0] == StepShape(10, 3)
    assert proposed(seqs[1:3], left, schedule, 64) == {} and len(schedule.seen) == 2
    assert proposed(seqs, left, None, 64)["a"].token_ids == [1, 2, 3]


class Grammar:
    """A grammar that accepts ``n`` drafts, recording what it was caught up with."""

    def __init__(self, n: int) -> None:
        self.n, self.caught_up, self.asked = n, [], []

    def catch_up(self, token_ids: list[int]) -> None:
        self.caught_up.append(list(token_ids))

    def draft_prefix(self, token_ids: list[int]) -> int:
        self.asked.append(list(token_ids))
        return self.n


def test_under_a_grammar_only_the_drafts_it_accepts_are_chosen() -> None:
    seq = decoding(3, 2)
    seq.structured_output = grammar = Grammar(2)  # type: ignore[assignment]
    stats = SpecDecodeStats()
    kept = cut_drafts(seq, 1, 64, FIVE, None, stats)
    assert kept.token_ids == [1, 2] and stats.chosen_lengths == [0, 0, 1]
    assert grammar.caught_up == [[3, 4]] and grammar.asked == [[1, 2, 3, 4, 5]]


def test_the_schedule_gets_each_drafts_confidence() -> None:
    seq = running("a", 8, 7, [1, 2])
    seq.spec_confidence = (0.5, 0.25)
    seen: list[Draft] = []

    class Keep:
        def cut(self, drafts: dict[str, Draft], step: StepShape) -> dict[str, Draft]:
            seen.extend(drafts.values())
            return drafts

    proposed([seq], lambda s: 1, Keep(), 64)
    assert seen == [Draft([1, 2], None, (0.5, 0.25))]


# ------------------------------------------------------------ the request checker's refusals


def test_each_refusal_names_what_is_wrong_exactly() -> None:
    c = checker(max_model_len=64)
    with pytest.raises(ValueError, match=r"^this model folder has no tokenizer.json; pass token ids$"):  # fmt: skip
        c.check("a", "text")
    with pytest.raises(ValueError, match=r"^prompt is empty$"):
        c.check("a", [])
    with pytest.raises(ValueError, match=r"^prompt token ids must be integers in \[0, 100\)$"):
        c.check("a", [1, 100])
    bias = SamplingParams(logit_bias={99: 1.0, 100: 1.0, 150: 1.0})
    with pytest.raises(ValueError, match=r"^logit_bias names token id 100, outside the vocabulary \[0, 100\)$"):  # fmt: skip
        c.check("a", [1], bias)
    assert c.check("a", [0, 99], SamplingParams(logit_bias={99: 1.0})).token_ids == [0, 99]


def test_a_text_prompt_is_tokenized_by_the_models_tokenizer() -> None:
    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    c = RequestChecker(tokenizer, 320, 64, None, 0)  # type: ignore[arg-type]
    text = "The scheduler admits a request."
    assert c.check("a", text).token_ids == tokenizer.encode(text).ids
    assert c.tokenizer is tokenizer


def test_the_body_clock_stops_at_a_body_without_more_and_passes_other_scopes(monkeypatch) -> None:
    waits: list[float] = []

    async def wait_for(awaitable, timeout: float):
        waits.append(timeout)
        return await awaitable

    monkeypatch.setattr(read_timeouts.asyncio, "wait_for", wait_for)
    pieces = [{"type": "http.request", "body": b"a"}]  # no more_body: the whole body

    async def receive() -> dict:
        return pieces.pop(0) if pieces else {"type": "http.disconnect"}

    async def app(scope, receive, send) -> None:
        await receive()
        await receive()

    asyncio.run(BodyTimeout(app, 1.5)({"type": "http"}, receive, None))  # type: ignore[arg-type]
    assert waits == [1.5]
    called = []

    async def lifespan(*args) -> None:
        called.append(args)

    scope, send = {"type": "lifespan"}, object()
    asyncio.run(BodyTimeout(lifespan, 1.5)(scope, receive, send))  # type: ignore[arg-type]
    assert called == [(scope, receive, send)] and waits == [1.5]


def test_a_body_timeout_outside_the_apps_handlers_is_a_408_in_openais_shape(monkeypatch) -> None:
    async def wait_for(awaitable, timeout: float):
        awaitable.close()
        raise TimeoutError

    monkeypatch.setattr(read_timeouts.asyncio, "wait_for", wait_for)
    sent: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": True}

    async def send(message: dict) -> None:
        sent.append(message)

    async def app(scope, receive, send) -> None:
        await receive()  # as a middleware reading the body before the handlers would

    scope = {"type": "http", "method": "POST", "path": "/", "headers": []}
    asyncio.run(BodyTimeout(app, 1.5)(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 408
    error = json.loads(sent[1]["body"])["error"]
    assert error["message"] == "the request body paused for more than 1.5 s"
    assert error["type"] == "invalid_request_error"


def test_a_kept_alive_connection_starts_the_head_clock_again(monkeypatch) -> None:
    monkeypatch.setattr(H11Protocol, "on_response_complete", lambda self: None)
    protocol = object.__new__(HeadTimeoutProtocol)
    protocol.head_timeout, protocol.head_timer, protocol.cycle = 2.5, None, None
    protocol.loop = clock = Clock()  # type: ignore[assignment]

    class Transport:
        closing = False

        def is_closing(self) -> bool:
            return self.closing

    protocol.transport = transport = Transport()  # type: ignore[assignment]
    protocol.on_response_complete()
    assert clock.calls == [2.5]
    transport.closing = True
    protocol._stop_clock()
    protocol.on_response_complete()  # closing: no clock
    assert clock.calls == [2.5] and protocol.head_timer is None
    clock.loop.close()


def test_a_structured_request_gets_its_grammar_from_the_checkers_manager() -> None:
    tokenizer = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    vocab = tokenizer.get_vocab_size()
    manager = StructuredOutputManager(tokenizer, vocab, [2])
    c = RequestChecker(tokenizer, vocab, 64, manager, 0)
    spec = StructuredOutputsParams(choice=["yes", "no"])
    seq = c.check("a", [5, 6], SamplingParams(structured_outputs=spec))
    assert seq.structured_output is not None
    assert seq.structured_output.compiled is manager.compile(spec)


def test_the_head_clock_waits_for_a_new_head_and_a_late_one_closes_once(monkeypatch) -> None:
    monkeypatch.setattr(H11Protocol, "handle_events", lambda self: None)
    protocol = object.__new__(HeadTimeoutProtocol)
    protocol.head_timeout, protocol.head_timer = 2.5, None
    protocol.cycle = kept = object()  # the last request's cycle, on a kept-alive connection
    protocol.loop = clock = Clock()  # type: ignore[assignment]
    closed: list[bool] = []

    class Transport:
        def is_closing(self) -> bool:
            return bool(closed)

        def close(self) -> None:
            closed.append(True)

    protocol.transport = Transport()  # type: ignore[assignment]
    protocol._start_clock()
    protocol.handle_events()  # bytes of the next head, not yet whole: the clock runs
    assert protocol.head_timer is clock.handles[0] and protocol.waiting_cycle is kept
    protocol.cycle = object()  # the head came whole: a new cycle
    protocol.handle_events()
    assert protocol.head_timer is None and clock.handles[0].cancelled()
    protocol._start_clock()
    protocol._late()
    assert closed == [True] and protocol.head_timer is None
    protocol._stop_clock()  # as connection_lost does after: nothing left to cancel
    protocol._late()  # already closing: not closed twice
    assert closed == [True]
    clock.loop.close()
