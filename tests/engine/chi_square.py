"""A chi-square goodness-of-fit test without scipy, for the sampling tests."""

from __future__ import annotations

import math

import torch

Z_1E3 = 3.0902  # the standard normal's upper 1e-3 quantile


def chi2_quantile(df: int, z: float = Z_1E3) -> float:
    """The chi-square upper quantile at the normal quantile ``z`` (Wilson and
    Hilferty's cube-root approximation; within about 1% for df >= 10)."""
    c = 2.0 / (9.0 * df)
    return df * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(observed: torch.Tensor, expected_probs: torch.Tensor) -> tuple[float, float]:
    """(statistic, the 1e-3 critical value) of counts against exact probabilities.
    Cells expected below 5 are pooled into one; a count in a cell of probability
    0 makes the statistic infinite (the sampler produced an impossible outcome)."""
    n = observed.sum().item()
    expected = expected_probs.double() * n
    if (observed[expected_probs == 0] > 0).any():
        return math.inf, chi2_quantile(1)
    big = expected >= 5
    obs = torch.cat([observed[big].double(), observed[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum().item()
    return stat, chi2_quantile(len(exp) - 1)
