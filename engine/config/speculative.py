"""`speculative_config`, shaped like vLLM's: which proposer, and how many drafts."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config.model import ModelConfig

METHODS = ("ngram", "draft_model", "mtp")
SCHEDULES = ("fixed", "confidence")  # how many drafts to verify (verify_length.py)
CONFIDENT = ("draft_model",)  # the proposers that say how sure they are of a draft


@dataclass(frozen=True)
class SpeculativeConfig:
    """``num_speculative_tokens`` is k, the most drafts any request verifies in a
    step. The n-gram proposer matches suffixes of prompt_lookup_min to
    prompt_lookup_max tokens; ``model`` names a draft model's folder."""

    method: str
    num_speculative_tokens: int
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # "fixed" verifies every draft; "confidence" verifies, per request, as many
    # as pay off (DSpark's question), at most verify_budget draft tokens a step
    # (None: the step's token budget), with step times measured at start-up or
    # read from step_time_profile (a JSON file that StepTimeProfile.save writes).
    verify_schedule: str = "fixed"
    verify_budget: int | None = None
    step_time_profile: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(
                f"speculative_config method must be one of {', '.join(METHODS)}, "
                f"got {self.method!r}"
            )
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(f"speculative_config num_speculative_tokens must be >= 1, got {k!r}")
        self._check_lookup()
        self._check_model()
        self._check_schedule()

    def _check_lookup(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not all(isinstance(n, int) and not isinstance(n, bool) for n in (lo, hi)):
            raise ValueError("speculative_config prompt_lookup_min and _max must be integers")
        if lo < 1 or lo > hi:
            raise ValueError(
                "speculative_config needs 1 <= prompt_lookup_min <= prompt_lookup_max, "
                f"got {lo} and {hi}"
            )

    def _check_model(self) -> None:
        if self.method in ("ngram", "mtp") and self.model is not None:
            raise ValueError(f"speculative_config method {self.method!r} takes no model")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("speculative_config method 'draft_model' needs a model")
        if self.model is not None and not Path(self.model).is_dir():
            raise ValueError(f"speculative_config model {self.model!r} is not a directory")

    def _check_schedule(self) -> None:
        if self.verify_schedule not in SCHEDULES:
            raise ValueError(
                f"speculative_config verify_schedule must be one of {', '.join(SCHEDULES)}, "
                f"got {self.verify_schedule!r}"
            )
        if self.verify_schedule == "confidence" and self.method not in CONFIDENT:
            raise ValueError(
                "speculative_config verify_schedule 'confidence' needs a proposer that says "
                f"how sure it is of each draft ({' or '.join(CONFIDENT)}), not {self.method!r}"
            )
        b = self.verify_budget
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 0):
            raise ValueError(f"speculative_config verify_budget must be >= 0, got {b!r}")
        path = self.step_time_profile
        if path is not None and not Path(path).is_file():
            raise ValueError(f"speculative_config step_time_profile {path!r} is not a file")

    def check_target(self, model: ModelConfig) -> None:
        """Refuse what the target model cannot do: MTP drafts need the checkpoint's
        own MTP module (DeepSeek-V3's, V3.2's or V4's num_nextn_predict_layers, with its weights).
        EngineConfig calls this, before any worker starts or any weight loads."""
        if self.method == "mtp" and model.num_mtp_layers == 0:
            raise ValueError(
                "speculative_config method 'mtp' needs a model with multi-token prediction "
                f"weights (DeepSeek-V3's, V3.2's or V4's MTP module); this {model.architecture} checkpoint "
                "has none"
            )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM-shaped keys; an unknown key is an error that names it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key {unknown[0]!r}")
        if "method" not in values or "num_speculative_tokens" not in values:
            raise ValueError("speculative_config needs 'method' and 'num_speculative_tokens'")
        return cls(**values)

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict[str, Any] | str) -> SpeculativeConfig:
        """A config, its dict, or its JSON text (as --speculative-config takes it)."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"speculative_config is not valid JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        return cls.from_dict(value)
