"""How one request wants its tokens chosen and when it wants to stop."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

# float32's smallest positive (subnormal) and largest numbers: the sampler's logits
# are float32, and a penalty outside this range rounds to 0 or infinity there.
FLOAT32_TINIEST = 1.401298464324817e-45
FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(Enum):
    """Which outputs a request's caller gets, named as in vLLM: CUMULATIVE, one
    per step with everything so far (what a stream reads); FINAL_ONLY, the last
    one alone (what LLM.generate reads), which lets the output processor skip
    building the others and spell the text once, at the end."""

    CUMULATIVE = 0
    FINAL_ONLY = 2


@dataclass
class StructuredOutputsParams:
    """A constraint on a request's output, named as in vLLM: exactly one of a
    JSON schema (a dict or its text), any JSON object, a regular expression, a
    list of choices, or an EBNF grammar (xgrammar's dialect, rule ``root``).

    The engine compiles it with xgrammar when the request is added; a spec that
    does not compile is a ValueError there (engine/structured_output/).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # JSON: no whitespace outside strings

    def __post_init__(self) -> None:
        kinds = [self.json, self.regex, self.choice, self.grammar, self.json_object or None]
        if sum(k is not None for k in kinds) != 1:
            raise ValueError(
                "structured_outputs needs exactly one of json, regex, choice, grammar "
                "or json_object"
            )
        if self.choice is not None and (not self.choice or not all(self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")


SAMPLING_EPS = 1e-5  # a temperature below this is greedy, as in vLLM


@dataclass
class SamplingParams:
    """Per-request sampling settings, with the same names and meanings as vLLM's.

    temperature 0 means greedy, as does any below SAMPLING_EPS (vLLM's rule):
    dividing logits by a temperature near zero overflows. top_k 0 (or -1) and
    top_p 1 switch those filters off; min_p 0 does too. A request with a seed draws its tokens from its own
    random stream, so its output does not depend on what else is in the batch.

    The logits are adjusted first, as vLLM adjusts them: ``logit_bias`` is added
    to the named tokens (clamped to [-100, 100], as OpenAI says); until
    ``min_tokens`` tokens are out, EOS and ``stop_token_ids`` are at -inf, and no
    stop string ends the text; ``repetition_penalty`` divides a positive logit of
    any token in the prompt or the output, and multiplies a negative one; then
    ``frequency_penalty`` times each token's count in the output, and
    ``presence_penalty`` for each token the output holds, are subtracted (OpenAI's
    definition). With ``include_stop_str_in_output`` the matched stop string, or
    the stop token's text, stays at the end of the text.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None  # how many top logprobs to return per generated token
    # How many top logprobs to return per prompt token after the first (vLLM's
    # prompt_logprobs): the model's own, given the prompt before it. Such a
    # request takes no prefix-cache hit, whose tokens' logits were never computed.
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output follows
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be >= 0, got {self.prompt_logprobs}")
        self._check_adjustments()

    def _check_adjustments(self) -> None:
        """The penalties, min_tokens and logit_bias, in vLLM's ranges; the biases clamped."""
        penalties = {"presence_penalty": self.presence_penalty}
        penalties["frequency_penalty"] = self.frequency_penalty
        for name, value in penalties.items():
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
        if not FLOAT32_TINIEST <= self.repetition_penalty <= FLOAT32_MAX:
            raise ValueError(  # the sampler divides float32 logits by it: 5e-324 becomes 0
                f"repetition_penalty must be > 0 and within float32's range "
                f"[{FLOAT32_TINIEST:.4g}, {FLOAT32_MAX:.4g}], got {self.repetition_penalty}"
            )
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.logit_bias is not None:
            if any(not isinstance(t, int) or t < 0 for t in self.logit_bias):
                raise ValueError("logit_bias keys must be token ids, non-negative integers")
            self.logit_bias = {t: min(100.0, max(-100.0, b)) for t, b in self.logit_bias.items()}

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Does any penalty change this request's logits? Then the model runner
        needs the request's output tokens every step it samples."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )
