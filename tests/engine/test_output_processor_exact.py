"""The output processor pinned to exact values (issue 49): which outputs a step
yields and when, the requests a stop string ends, what a handed-on request has
shown, logprob entries, the clock's marks and the copies an output takes.
Outputs are typed in by hand, as the engine core hands them on, with the tiny
checkpoint's tokenizer (snippets/models/deepinfer-tiny)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from engine.core import output_processor as op
from engine.core.output_processor import OutputProcessor, logprob_entry
from engine.kv.handoff import Handoff
from engine.outputs import EngineCoreEvent, EngineCoreEventType, EngineCoreOutput, FinishReason
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import ROOT

TOK = Tokenizer.from_file(str(ROOT / "snippets" / "models" / "deepinfer-tiny" / "tokenizer.json"))
HELLO = [40, 1472, 277, 1653, 1080]  # "H", "el", "lo", " wor", "ld"
STOP_HERE = [1132, 2311, 14]  # " stop", " here", "."
CUMULATIVE = RequestOutputKind.CUMULATIVE
FINAL = RequestOutputKind.FINAL_ONLY


def out(ids: list[int], reason: FinishReason | None = None, **kw) -> list[EngineCoreOutput]:
    return [EngineCoreOutput("r", ids, finish_reason=reason, **kw)]


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """time.perf_counter as the output processor reads it: 1.0, 2.0, 3.0, ..."""
    ticks = [0.0]

    def tick() -> float:
        ticks[0] += 1.0
        return ticks[0]

    monkeypatch.setattr(op.time, "perf_counter", tick)
    return ticks


def test_cumulative_outputs_every_step_and_forgets_a_finished_request(clock) -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("r", "p", [7, 8], SamplingParams(output_kind=CUMULATIVE))
    assert proc.states["r"].times.arrival == 1.0
    first = proc.process_outputs(out(HELLO[:2], num_cached_tokens=3))
    assert first.reqs_to_abort == []
    [o] = first.request_outputs
    assert (o.request_id, o.prompt, o.prompt_token_ids) == ("r", "p", [7, 8])
    assert o.token_ids == HELLO[:2] and o.text == "Hel" and not o.finished
    assert o.finish_reason is None and o.num_cached_tokens == 3 and o.logprobs is None
    assert (o.times.arrival, o.times.first_token, o.times.finished) == (1.0, 2.0, None)
    second = proc.process_outputs(out(HELLO[2:], FinishReason.LENGTH, num_cached_tokens=0))
    [o2] = second.request_outputs
    assert second.reqs_to_abort == []
    assert o2.token_ids == HELLO and o2.text == "Hello world" and o2.finished
    assert o2.finish_reason == FinishReason.LENGTH and o2.num_cached_tokens == 0
    assert (o2.times.arrival, o2.times.first_token, o2.times.finished) == (1.0, 2.0, 3.0)
    assert o.token_ids == HELLO[:2] and o.times.finished is None  # the first was a copy
    assert "r" not in proc.states


def test_final_only_outputs_once_at_the_end(clock) -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("r", None, [7], SamplingParams(output_kind=FINAL))
    assert proc.states["r"].final_only
    assert proc.process_outputs(out(HELLO[:3])).request_outputs == []
    assert proc.states["r"].unshown == HELLO[:3]
    assert proc.process_outputs(out(HELLO[3:4])).request_outputs == []
    done = proc.process_outputs(out(HELLO[4:], FinishReason.STOP))
    [o] = done.request_outputs
    assert done.reqs_to_abort == []  # the core stopped it: nothing to abort
    assert o.text == "Hello wor" and o.token_ids == HELLO  # a stop token's text is not shown
    assert o.finish_reason == FinishReason.STOP and o.finished
    assert (o.times.first_token, o.times.finished) == (2.0, 4.0)


def test_final_only_with_a_stop_string_grows_the_text_and_aborts_in_the_core() -> None:
    proc = OutputProcessor(TOK)
    params = SamplingParams(output_kind=FINAL, stop=[" wor"])
    proc.add_request("r", None, [7], params)
    assert not proc.states["r"].final_only
    assert proc.process_outputs(out(HELLO[:3])).request_outputs == []
    done = proc.process_outputs(out(HELLO[3:]))
    assert done.reqs_to_abort == ["r"]
    [o] = done.request_outputs
    assert o.text == "Hello" and o.finish_reason == FinishReason.STOP and o.token_ids == HELLO
    assert proc.states == {}


def test_a_stop_string_in_the_core_stopped_step_is_not_aborted_again() -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("r", None, [7], SamplingParams(stop=["el"], include_stop_str_in_output=True))
    done = proc.process_outputs(out(HELLO[:3], FinishReason.LENGTH))
    assert done.reqs_to_abort == []
    assert done.request_outputs[0].text == "Hel"
    assert done.request_outputs[0].finish_reason == FinishReason.STOP


def test_without_a_tokenizer_only_ids() -> None:
    proc = OutputProcessor(None)
    proc.add_request("r", None, [7], SamplingParams(output_kind=FINAL))
    assert proc.states["r"].detokenizer is None and proc.shown("r") == 0
    [o] = proc.process_outputs(out([5, 6], FinishReason.LENGTH)).request_outputs
    assert o.text == "" and o.token_ids == [5, 6]
    proc.add_request("h", None, [7], SamplingParams(), Handoff([5, 6, 9], num_sent_tokens=2))
    assert proc.shown("h") == 0 and proc.states["h"].unshown == [9]


def test_a_handed_on_request_continues_where_its_client_left_off() -> None:
    proc = OutputProcessor(TOK)
    prompt = [7, 8]
    proc.add_request("r", None, prompt, SamplingParams(), Handoff(HELLO[:4], num_sent_tokens=2))
    state = proc.states["r"]
    assert state.token_ids == HELLO[:4] and state.token_ids is not HELLO
    assert state.unshown == HELLO[2:4] and proc.shown("r") == 3  # "Hel"
    assert state.prompt_token_ids == prompt and state.prompt_token_ids is not prompt
    [o] = proc.process_outputs(out(HELLO[4:], FinishReason.LENGTH)).request_outputs
    assert o.text == "Hello world" and o.token_ids == HELLO
    proc.add_request("s", None, [7], SamplingParams(stop=["xyz"]), Handoff(HELLO, 5))
    assert proc.shown("s") == len("Hello world") - 2  # "xyz" could begin in the last two


def test_abort_forgets_and_tolerates_an_unknown_request() -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("r", None, [7], SamplingParams())
    proc.abort_request("r")
    proc.abort_request("r")
    assert proc.states == {}


def test_logprobs_events_and_prompt_logprobs_are_collected_exactly() -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("r", None, [7, 8, 9], SamplingParams(logprobs=1, prompt_logprobs=2))
    ev = [EngineCoreEvent(4, EngineCoreEventType.SCHEDULED, 1, 3, 0.5)]
    prompt_lp = [([8, 3, 4, 5], [-0.5, -0.25, -1.5, -2.0]), ([9, 9, 1], [-1.0, -1.0, -3.0])]
    first = proc.process_outputs(
        out(HELLO[:1], new_logprobs=[([40, 2, 40], [-0.5, -0.125, -0.5])],
            events=ev, prompt_logprobs=prompt_lp)
    )  # fmt: skip
    [o] = first.request_outputs
    assert o.logprobs == [{2: -0.125, 40: -0.5}]
    assert o.prompt_logprobs == [None, {3: -0.25, 4: -1.5, 8: -0.5}, {9: -1.0, 1: -3.0}]
    assert o.events == ev
    ev2 = [EngineCoreEvent(9, EngineCoreEventType.PREEMPTED, 2, 4, 0.75)]
    [o2] = proc.process_outputs(
        out(HELLO[1:2], FinishReason.LENGTH, new_logprobs=[([1472, 1472], [-0.25, -0.25])],
            events=ev2)
    ).request_outputs  # fmt: skip
    assert o2.logprobs == [{2: -0.125, 40: -0.5}, {1472: -0.25}]
    assert o2.events == ev + ev2 and o.events == ev  # each output holds its own list
    assert o2.prompt_logprobs == o.prompt_logprobs  # they arrive once


def test_logprob_entry_takes_the_top_n_and_the_chosen_token() -> None:
    ids, values = [5, 7, 9, 11], [-1.0, -2.0, -3.0, -4.0]
    assert logprob_entry(ids, values, 2) == {7: -2.0, 9: -3.0, 5: -1.0}
    assert logprob_entry(ids, values, 0) == {5: -1.0}
    assert logprob_entry(ids, values, 3) == {7: -2.0, 9: -3.0, 11: -4.0, 5: -1.0}
    assert list(logprob_entry(ids, values, 1)) == [7, 5]  # top first, then the chosen


def test_two_requests_in_one_step_keep_their_own_state() -> None:
    proc = OutputProcessor(TOK)
    proc.add_request("a", None, [7], SamplingParams(stop=[" here"]))
    proc.add_request("b", None, [7], SamplingParams())
    done = proc.process_outputs(
        [EngineCoreOutput("a", STOP_HERE), EngineCoreOutput("b", HELLO[:2])]
    )
    assert done.reqs_to_abort == ["a"]
    assert [(o.request_id, o.text, o.finished) for o in done.request_outputs] == [
        ("a", " stop", True),
        ("b", "Hel", False),
    ]
    assert list(proc.states) == ["b"]


def test_a_handed_on_final_only_request_spells_the_rest_at_the_end() -> None:
    proc = OutputProcessor(TOK)
    params = SamplingParams(output_kind=FINAL)
    proc.add_request("r", None, [7], params, Handoff(HELLO[:4], num_sent_tokens=2))
    assert proc.states["r"].unshown == HELLO[2:4]
    [o] = proc.process_outputs(out(HELLO[4:], FinishReason.LENGTH)).request_outputs
    assert o.text == "Hello world" and o.token_ids == HELLO


def test_a_handoff_that_ends_mid_character_holds_its_bytes_back() -> None:
    cafe = [67, 1435, 128, 103, 221]  # "c", "af", then "é" in two tokens, " "
    proc = OutputProcessor(TOK)
    proc.add_request("r", None, [7], SamplingParams(), Handoff(cafe[:4], num_sent_tokens=3))
    assert proc.shown("r") == 3  # "caf": half of "é" is not shown
    [o] = proc.process_outputs(out(cafe[4:], FinishReason.LENGTH)).request_outputs
    assert o.text == "café "
