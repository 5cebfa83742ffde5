"""Compiling grammars, once per distinct spec (the most recent few kept), and
filling a step's token masks."""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from collections.abc import Collection, Mapping
from contextlib import suppress
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.sampling_params import StructuredOutputsParams
from engine.scheduler_output import GrammarOutput, SchedulerOutput
from engine.structured_output.request import StructuredOutputRequest
from engine.utils import cdiv

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# xgrammar's errors begin with a time and a C++ source location: keep the message.
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")
# Compiled grammars kept for reuse, least recently used dropped first: every
# distinct schema a client sends is a new one, so an unbounded cache would grow
# with the server's traffic. A request holds its own grammar while it runs.
MAX_CACHED_GRAMMARS = 128
JSON_OBJECT = '{"type": "object"}'  # json_object's schema, where whitespace is not free


class GrammarHolder(Protocol):
    """What a mask needs of a request: its matcher, and the tokens it has made."""

    @property
    def structured_output(self) -> StructuredOutputRequest | None: ...

    @property
    def output_token_ids(self) -> list[int]: ...


class StructuredOutputManager:
    def __init__(
        self,
        tokenizer: Tokenizer | None,
        vocab_size: int,
        eos_token_ids: Collection[int],
        disable_any_whitespace: bool = False,
    ) -> None:
        """``disable_any_whitespace``: EngineConfig's, for every request's JSON
        grammar; False leaves it to each request's own field."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's: its embedding rows, which the mask covers
        self.eos_token_ids = list(eos_token_ids)
        self.disable_any_whitespace = disable_any_whitespace
        self.grammars: OrderedDict[tuple, Any] = OrderedDict()  # spec -> compiled grammar
        self._compiler: Any = None

    def request_for(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        """A fresh matcher for a new request; ValueError if the spec does not
        compile, or allows no first token at all (an empty grammar, a schema no
        value meets): sampling under an empty mask would pick a token it forbids."""
        request = StructuredOutputRequest(self.compile(params))
        mask = self.empty_bitmask(1)
        request.fill_bitmask(mask, 0)
        if not mask.any():
            raise ValueError("the output constraint allows no token at all: nothing can follow")
        return request

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of ``params``, compiled unless it is still cached."""
        kind, spec = _spec(params)
        key = (kind, spec, params.disable_any_whitespace)
        if key in self.grammars:
            self.grammars.move_to_end(key)
            return self.grammars[key]
        try:
            grammar = self._compile(kind, spec, params.disable_any_whitespace)
        except RuntimeError as e:
            message = _LOCATION.sub("", str(e).strip().splitlines()[0])
            raise ValueError(f"invalid {kind} for structured output: {message}") from None
        self.grammars[key] = grammar
        if len(self.grammars) > MAX_CACHED_GRAMMARS:
            self.grammars.popitem(last=False)
        return grammar

    def _compile(self, kind: str, spec: str, no_whitespace: bool) -> Any:
        """Without whitespace (the request's or the engine's choice), JSON allows
        only the separators ", " and ": " between tokens, as vLLM compiles it; a
        JSON object is then the schema {"type": "object"}, as in vLLM."""
        compiler = self.compiler()
        any_whitespace = not (no_whitespace or self.disable_any_whitespace)
        if kind == "JSON schema":
            return compiler.compile_json_schema(spec, any_whitespace=any_whitespace)
        if kind == "JSON object" and not any_whitespace:
            return compiler.compile_json_schema(JSON_OBJECT, any_whitespace=False)
        if kind == "JSON object":
            return compiler.compile_builtin_json_grammar()
        if kind == "regex":
            return compiler.compile_regex(spec)
        return compiler.compile_grammar(spec)  # an EBNF grammar, or the choices as one

    def compiler(self) -> Any:
        """xgrammar's compiler over this model's vocabulary, made on first use."""
        if self._compiler is None:
            import xgrammar as xgr

            if self.tokenizer is None:
                raise ValueError("structured output needs the model folder's tokenizer.json")
            vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
            info = xgr.TokenizerInfo(
                [token for token, _ in vocab],
                vocab_type=xgr.VocabType.BYTE_LEVEL,
                vocab_size=self.vocab_size,  # ids past the tokenizer's are never allowed
                stop_token_ids=self.eos_token_ids,
            )
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def fill_bitmask(
        self, scheduler_output: SchedulerOutput, requests: Mapping[str, GrammarHolder]
    ) -> None:
        """Set ``scheduler_output.grammar``: the tokens allowed to every row that
        samples under a grammar this step, from every token it has so far, and
        after each of its drafts in turn (a row per verified position). Bit j
        of word w of a row allows token 32 * w + j."""
        req_ids = self.requests_needing_tokens(scheduler_output, requests)
        if not req_ids:
            return
        drafts = {item.req_id: item.draft_token_ids for item in scheduler_output.scheduled}
        bitmask = self.empty_bitmask(sum(1 + len(drafts[r]) for r in req_ids))
        row, row_ids = 0, []
        for req_id in req_ids:
            seq = requests[req_id]
            seq.structured_output.catch_up(seq.output_token_ids)
            seq.structured_output.fill_bitmasks(bitmask, row, drafts[req_id])
            row_ids += [req_id] * (1 + len(drafts[req_id]))
            row += 1 + len(drafts[req_id])
        scheduler_output.grammar = GrammarOutput(row_ids, bitmask)

    def empty_bitmask(self, rows: int) -> torch.Tensor:
        """Room for ``rows`` masks over the model's vocabulary, nothing allowed yet."""
        return torch.zeros((rows, cdiv(self.vocab_size, 32)), dtype=torch.int32)

    @staticmethod
    def requests_needing_tokens(
        scheduler_output: SchedulerOutput, requests: Mapping[str, GrammarHolder]
    ) -> list[str]:
        """The scheduled requests that sample under a grammar. Their masks need
        their previous tokens: a sync point for an engine that runs ahead."""
        return [
            item.req_id
            for item in scheduler_output.scheduled
            if item.samples and requests[item.req_id].structured_output is not None
        ]


def _spec(params: StructuredOutputsParams) -> tuple[str, str]:
    """(what kind of constraint, its text), the text canonical so that equal
    specs share one compiled grammar."""
    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        with suppress(ValueError):  # invalid JSON: xgrammar reports it
            # A dict and its text are one spec, whatever the spacing or key order.
            schema = json.dumps(json.loads(schema), sort_keys=True)
        return "JSON schema", schema
    if params.json_object:
        return "JSON object", ""
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", "root ::= " + " | ".join(json.dumps(c) for c in params.choice)
    return "grammar", params.grammar
