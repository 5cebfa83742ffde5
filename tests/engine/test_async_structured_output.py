"""Structured output with async (one-step-ahead) scheduling: a grammar request
makes the engine wait for its newest token before its next mask is built, and
nothing a caller sees changes. JSON schema, regex and choice requests, mixed in
one batch with free-text ones, get the serial engine's tokens, greedy and
seeded, preempted or not; only calls that schedule after a grammar request's
token was in flight sync, and a batch without one never does."""

from __future__ import annotations

import re

import pytest

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.outputs import EngineCoreEventType, RequestOutput
from tests.engine.test_structured_output import CHOICES, REGEX, SCHEMA, TINY, follows_schema

SPECS = [
    None,  # free text
    None,
    StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    StructuredOutputsParams(regex=REGEX),
    StructuredOutputsParams(choice=CHOICES),
]  # the grammar requests arrive last: preemption takes the newest first
PROMPTS = ["x = 1", "The scheduler", "The KV cache", "A step is", "Pick one:"]
TIGHT = dict(num_kv_blocks=12, block_size=4, max_num_batched_tokens=24)  # preempts


def mixed(temperature: float, free_tokens: int = 48) -> list[SamplingParams]:
    """The grammar requests stop by their grammar, the free-text ones run longer."""
    return [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=64 if spec is not None else free_tokens,
            structured_outputs=spec,
            ignore_eos=spec is None,
        )
        for i, spec in enumerate(SPECS)
    ]


def spy_on_syncs(llm: LLM) -> list[tuple[bool, bool]]:
    """For each call of must_sync: (had a running request a grammar?, its answer)."""
    scheduler = llm.llm_engine.scheduler
    must_sync, answers = scheduler.must_sync, []

    def spied() -> bool:
        grammar = any(seq.structured_output is not None for seq in scheduler.running)
        answers.append((grammar, must_sync()))
        return answers[-1][1]

    scheduler.must_sync = spied
    return answers


def assert_valid(outputs: list[RequestOutput]) -> None:
    json_out, regex_out, choice_out = outputs[2:]
    assert follows_schema(json_out.text), json_out.text
    assert re.fullmatch(REGEX, regex_out.text), regex_out.text
    assert choice_out.text in CHOICES, choice_out.text
    assert all(o.finish_reason == "stop" for o in outputs[2:])


@pytest.mark.parametrize(
    "temperature, kwargs",
    [(0.0, {}), (1.0, {}), (0.0, TIGHT), (1.0, TIGHT)],
    ids=["greedy", "seeded", "greedy-preempted", "seeded-preempted"],
)
def test_grammar_requests_get_the_serial_engines_tokens(temperature, kwargs) -> None:
    params = mixed(temperature)
    serial = LLM(TINY, dtype="float32", **kwargs)
    off = serial.generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(TINY, dtype="float32", async_scheduling=True, **kwargs)
    answers = spy_on_syncs(llm)
    on = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [(o.token_ids, o.finish_reason) for o in on] == [
        (o.token_ids, o.finish_reason) for o in off
    ]
    assert [o.text for o in on] == [o.text for o in off]
    assert_valid(on)
    if kwargs:  # the grammar requests were preempted and resumed
        preempted = [e.type is EngineCoreEventType.PREEMPTED for o in on[2:] for e in o.events]
        assert any(preempted)
    engine = llm.llm_engine
    assert engine.async_loop.num_syncs == sum(answer for _, answer in answers) > 0
    # Once the grammar requests are done, the free-text ones overlap again.
    free = [answer for grammar, answer in answers if not grammar]
    assert free and not any(free), answers
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    assert not engine.has_unfinished_requests()


def test_a_batch_without_grammar_requests_never_syncs() -> None:
    """The step API: free text overlaps, a choice request arriving later makes the
    calls that follow its steps sync, and once it has finished none does."""
    llm = LLM(TINY, dtype="float32", async_scheduling=True)
    engine, answers = llm.llm_engine, spy_on_syncs(llm)
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(2):
        engine.add_request(f"free{i}", PROMPTS[i], free)
    for _ in range(4):
        engine.step()
    assert engine.async_loop.num_syncs == 0 and len(answers) == 3
    choice = SamplingParams(
        temperature=0, structured_outputs=StructuredOutputsParams(choice=CHOICES)
    )
    engine.add_request("choice", PROMPTS[4], choice)
    matcher = engine.requests["choice"].structured_output
    done: dict[str, RequestOutput] = {}
    grammar_steps = 0
    while engine.has_unfinished_requests():
        grammar_steps += "choice" in engine.requests
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done["choice"].text in CHOICES
    # Its matcher accepted each token as it arrived, the last (its stop token) too.
    assert matcher.num_accepted == len(done["choice"].token_ids) and matcher.is_terminated()
    syncs = engine.async_loop.num_syncs
    assert 0 < syncs <= grammar_steps
    assert [answer for grammar, answer in answers if not grammar].count(True) == 0
    assert len(done["free0"].token_ids) == len(done["free1"].token_ids) == 24


def test_a_bad_grammar_is_refused_alone_with_async_scheduling() -> None:
    engine = LLM(TINY, dtype="float32", num_kv_blocks=16, async_scheduling=True).llm_engine
    good = SamplingParams(structured_outputs=StructuredOutputsParams(regex=REGEX))
    engine.add_request("good", "The KV cache", good)
    with pytest.raises(ValueError, match="invalid regex"):
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-"))
        engine.add_request("bad", "The KV cache", bad)
    assert list(engine.requests) == ["good"]
    texts = []
    while engine.has_unfinished_requests():
        texts += [o.text for o in engine.step() if o.finished]
    assert len(texts) == 1 and re.fullmatch(REGEX, texts[0]), texts
