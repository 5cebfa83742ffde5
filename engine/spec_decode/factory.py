"""The proposer a speculative_config asks for."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from engine.spec_decode.draft_model import DraftModelProposer, DraftRunner
from engine.spec_decode.ngram import NgramProposer
from engine.spec_decode.proposer import DraftProposer
from engine.spec_decode.verify_length import ConfidenceSchedule, StepTimeProfile

if TYPE_CHECKING:
    from engine.config import EngineConfig

PROFILE_MAX_TOKENS = 512  # the largest step measured at start-up; longer ones extrapolate


def make_proposer(
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    new_runner: Callable[[EngineConfig], DraftRunner],
) -> DraftProposer | None:
    """The proposer that reads the requests' tokens: None without speculation,
    and for MTP, which reads the step's hidden states instead (mtp.py). A draft
    model gets a cache of the target's ``num_blocks`` and more (draft_model.py),
    and a runner of its own from ``new_runner``."""
    spec = config.speculative_config
    if spec is None or spec.method == "mtp":
        return None
    if spec.method == "ngram":
        return NgramProposer.from_config(spec)
    if spec.method == "draft_model":
        return DraftModelProposer.from_config(config, num_blocks, max_model_len, new_runner)
    raise ValueError(f"speculative_config method {spec.method!r} has no proposer")


def make_verify_schedule(
    config: EngineConfig, measure: Callable[[list[int]], list[float]]
) -> ConfidenceSchedule | None:
    """The confidence schedule, if asked for; None for a fixed k. Its step times
    come from the profile file, or from ``measure`` (the executor's
    measure_step_times) at powers of two up to the step's token budget."""
    spec = config.speculative_config
    if spec is None or spec.verify_schedule == "fixed":
        return None
    if spec.step_time_profile is not None:
        profile = StepTimeProfile.load(spec.step_time_profile)
    else:
        top = max(2, min(config.max_num_batched_tokens, PROFILE_MAX_TOKENS))
        sizes = [2**i for i in range(top.bit_length()) if 2**i <= top]
        profile = StepTimeProfile(tuple(sizes), tuple(measure(sizes)))
    budget = config.max_num_batched_tokens if spec.verify_budget is None else spec.verify_budget
    return ConfidenceSchedule(budget, profile)
