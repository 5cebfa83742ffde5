"""Structured output through xgrammar: seeded samples that follow a JSON schema,
a regex or a list of choices, under preemption; a mask that really constrains;
bad specs refused alone; one compile per spec; matchers kept in step."""

from __future__ import annotations

import json
import re

import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.sample.sampler import GrammarMask, apply_grammar_bitmask
from engine.structured_output import StructuredOutputManager
from tests.conftest import ROOT

TINY = ROOT / "snippets" / "models" / "deepinfer-tiny"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "blocks": {"type": "integer"},
        "cached": {"type": "boolean"},
    },
    "required": ["name", "blocks", "cached"],
}
REGEX = r"(prefill|decode) [0-9]{1,3} tokens"
CHOICES = ["scheduler", "block manager", "sampler"]
GRAMMAR = """
root ::= step (", " step)?
step ::= ("prefill" | "decode") " " [1-9] [0-9]?
"""  # EBNF: the same language as GRAMMAR_AS_REGEX
GRAMMAR_AS_REGEX = r"(prefill|decode) [1-9][0-9]?(, (prefill|decode) [1-9][0-9]?)?"


def follows_schema(text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return (
        isinstance(value, dict)
        and set(value) == set(SCHEMA["properties"])
        and isinstance(value["name"], str)
        and len(value["name"]) <= 10
        and type(value["blocks"]) is int
        and isinstance(value["cached"], bool)
    )


def sampled(llm: LLM, n: int, structured: StructuredOutputsParams | None, most=48) -> list:
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=most, structured_outputs=structured)
        for s in range(n)
    ]
    return llm.generate(["The KV cache"] * n, params, use_tqdm=False)


@pytest.fixture(scope="module")
def tight() -> LLM:
    """A cache too small for the batch: requests are preempted and resumed."""
    return LLM(TINY, dtype="float32", num_kv_blocks=64, block_size=8, max_num_seqs=100)


def test_json_samples_validate_under_preemption(tight) -> None:
    before = tight.stats.preemptions
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    outs = sampled(tight, 100, spec)
    assert tight.stats.preemptions > before
    assert all(o.finish_reason == "stop" for o in outs)
    assert all(follows_schema(o.text) for o in outs), [o.text for o in outs]
    assert len({o.text for o in outs}) > 50  # sampled, not one answer repeated


def test_regex_grammar_and_choices_hold(tight) -> None:
    for o in sampled(tight, 16, StructuredOutputsParams(regex=REGEX)):
        assert o.finish_reason == "stop" and re.fullmatch(REGEX, o.text), o.text
    for o in sampled(tight, 16, StructuredOutputsParams(grammar=GRAMMAR)):
        assert o.finish_reason == "stop" and re.fullmatch(GRAMMAR_AS_REGEX, o.text), o.text
    outs = sampled(tight, 16, StructuredOutputsParams(choice=CHOICES))
    assert all(o.text in CHOICES for o in outs)


def test_without_the_mask_the_same_seeds_give_invalid_json(tight) -> None:
    assert not any(follows_schema(o.text) for o in sampled(tight, 12, None, most=24))


def test_seeded_structured_output_is_the_same_in_any_company() -> None:
    spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    one = SamplingParams(temperature=1.0, seed=7, max_tokens=64, structured_outputs=spec)
    alone = LLM(TINY, dtype="float32", batch_invariant=True).generate(
        "The KV cache", one, use_tqdm=False
    )
    crowd = LLM(TINY, dtype="float32", batch_invariant=True, num_kv_blocks=16, block_size=8)
    others = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    outs = crowd.generate(["x = 1"] * 5 + ["The KV cache"], [others] * 5 + [one], use_tqdm=False)
    assert crowd.stats.preemptions > 0
    assert outs[-1].token_ids == alone[0].token_ids


@pytest.mark.parametrize(
    "spec, kind, message",
    [
        (dict(json={"type": "objekt"}), "JSON schema", 'Unsupported type "objekt"'),
        (dict(json="{not json"), "JSON schema", "Failed to parse JSON"),
        (dict(regex="[a-"), "regex", "Unclosed '['"),
        (dict(grammar='root ::= "a" rule'), "grammar", 'Rule "rule" is not defined'),
    ],
)
def test_bad_specs_fail_in_add_request_and_others_finish(spec, kind, message) -> None:
    engine = LLM(TINY, dtype="float32", num_kv_blocks=16).llm_engine
    engine.add_request("good", "The KV cache", SamplingParams(temperature=0, max_tokens=4))
    with pytest.raises(
        ValueError, match=f"invalid {kind} for structured output: .*{re.escape(message)}"
    ):
        bad = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
        engine.add_request("bad", "The KV cache", bad)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["good"] and "bad" not in engine.requests


def test_exactly_one_constraint() -> None:
    for kwargs in ({}, dict(regex="a", choice=["a"])):
        with pytest.raises(ValueError, match="exactly one of"):
            StructuredOutputsParams(**kwargs)


def test_a_spec_compiles_once(tight) -> None:
    manager = tight.llm_engine.structured_output
    text = json.dumps(SCHEMA, indent=2)  # the same schema, spelt differently
    first = manager.compile(StructuredOutputsParams(json=SCHEMA))
    assert manager.compile(StructuredOutputsParams(json=text)) is first


def test_the_mask_covers_the_model_vocabulary_not_the_tokenizer() -> None:
    tokenizer = LLM(TINY, dtype="float32", num_kv_blocks=4).tokenizer
    extra = tokenizer.get_vocab_size() + 40  # embedding rows past the tokenizer's ids
    manager = StructuredOutputManager(tokenizer, extra, [0])
    req = manager.request_for(StructuredOutputsParams(json_object=True))
    bitmask = torch.zeros((1, -(-extra // 32)), dtype=torch.int32)
    req.fill_bitmask(bitmask, 0)
    logits = torch.zeros(1, extra)
    allowed = apply_grammar_bitmask(logits, GrammarMask(torch.tensor([0]), bitmask))[0] == 0
    assert allowed.any() and not allowed[tokenizer.get_vocab_size() :].any()


def test_bitmask_application_matches_xgrammar() -> None:
    import xgrammar as xgr

    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 300, generator=g)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 10), generator=g, dtype=torch.int32)
    rows = torch.tensor([4, 0, 2])
    ours = apply_grammar_bitmask(logits, GrammarMask(rows, bitmask))
    theirs, full = logits.clone(), torch.full((5, 10), -1, dtype=torch.int32)
    full[rows] = bitmask  # xgrammar's mask has a row for every row of logits
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist())
    assert torch.equal(ours, theirs)


def test_matcher_rebuilds_and_checks_drafts_without_moving(tight) -> None:
    manager = tight.llm_engine.structured_output
    spec = StructuredOutputsParams(regex=REGEX)
    tokens = tight.llm_engine.tokenizer.encode("decode 42 tokens").ids
    fresh, ahead = manager.request_for(spec), manager.request_for(spec)
    for t in tokens[:3]:
        fresh.accept(t)
    for t in tokens:
        ahead.accept(t)  # as if later tokens were dropped: it must come back
    ahead.catch_up(tokens[:3])
    masks = torch.zeros((2, -(-manager.vocab_size // 32)), dtype=torch.int32)
    fresh.fill_bitmask(masks, 0)
    ahead.fill_bitmask(masks, 1)
    assert torch.equal(masks[0], masks[1])
    assert fresh.validate_tokens(tokens[3:]) == len(tokens) - 3
    assert fresh.num_accepted == 3 and fresh.validate_tokens([tokens[0]] * 2) < 2


def test_a_constraint_that_allows_no_first_token_is_refused() -> None:
    """Sampling under an empty mask would pick a token the grammar forbids. A
    regex that matches only the empty string allows nothing but a stop token,
    and a model without one then allows nothing at all."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ROOT / "snippets/models/deepinfer-tiny/tokenizer.json"))
    empty = StructuredOutputsParams(regex="")
    with pytest.raises(ValueError, match="allows no token"):
        StructuredOutputManager(tok, 4096, eos_token_ids=[]).request_for(empty)
    StructuredOutputManager(tok, 4096, eos_token_ids=[0]).request_for(empty)  # may stop at once


def free_whitespace(text: str) -> list[int]:
    """Where ``text`` (JSON, maybe cut short) has whitespace outside its strings
    other than the one space a separator ", " or ": " ends with."""
    found, in_string, escaped = [], False, False
    for i, c in enumerate(text):
        if in_string:
            in_string, escaped = (escaped or c != '"'), (not escaped and c == "\\")
        elif c == '"':
            in_string = True
        elif c.isspace() and not (c == " " and i and text[i - 1] in ",:"):
            found.append(i)
    return found


def allowed_whitespace(manager: StructuredOutputManager, spec, prefix: str) -> list[str]:
    """The whitespace-only tokens ``spec``'s grammar allows after ``prefix``."""
    tokenizer = manager.tokenizer
    request = manager.request_for(spec)
    for token in tokenizer.encode(prefix).ids:
        request.accept(token)
    mask = manager.empty_bitmask(1)
    request.fill_bitmask(mask, 0)
    vocab = tokenizer.get_vocab_size()
    bits = (mask[0].unsqueeze(1) >> torch.arange(32)) & 1
    ids = bits.flatten()[:vocab].nonzero().flatten().tolist()
    texts = [tokenizer.decode([i]) for i in ids]
    return [t for t in texts if t and t.isspace()]


@pytest.mark.parametrize(
    "spec, outside, inside",
    [
        (StructuredOutputsParams(json_object=True), ["{", '{"a": 1', '{"a": [2'], '{"a": "b'),
        (
            StructuredOutputsParams(json=SCHEMA),
            ["{", '{"blocks": 12'],
            '{"blocks": 1, "cached": true, "name": "a',
        ),
    ],
    ids=["json_object", "json_schema"],
)
def test_engine_wide_disable_any_whitespace_allows_no_whitespace_token_outside_strings(
    spec, outside, inside
) -> None:
    """EngineConfig.disable_any_whitespace: a request that did not ask for it
    (what response_format sends) still gets no whitespace token between JSON
    tokens, where the engine without it allows many; strings keep theirs."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TINY / "tokenizer.json"))
    free = StructuredOutputManager(tok, tok.get_vocab_size(), [0])
    tight = StructuredOutputManager(tok, tok.get_vocab_size(), [0], disable_any_whitespace=True)
    for prefix in outside:
        assert allowed_whitespace(free, spec, prefix), prefix
        assert allowed_whitespace(tight, spec, prefix) == [], prefix
    assert allowed_whitespace(tight, spec, inside)  # a string may hold spaces


def test_llm_disable_any_whitespace_gives_json_without_free_whitespace(tight) -> None:
    """LLM(..., disable_any_whitespace=True): seeded json_object replies have no
    whitespace outside strings but the separators' spaces; the same seeds
    without the option spend tokens on it."""
    spec = StructuredOutputsParams(json_object=True)
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=60, structured_outputs=spec)
        for s in range(8)
    ]
    llm = LLM(TINY, dtype="float32", num_kv_blocks=64, disable_any_whitespace=True)
    compact = llm.generate(["The KV cache"] * 8, params, use_tqdm=False)
    assert not [o.text for o in compact if free_whitespace(o.text)]
    loose = tight.generate(["The KV cache"] * 8, params, use_tqdm=False)
    assert sum(len(free_whitespace(o.text)) for o in loose) > 0
