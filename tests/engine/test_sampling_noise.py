"""The sampler's random stream is the one Chapter 7 says it is: Experiment 24
derives each uniform number in pure Python "as DeepInfer's sampler does", and the
chapter claims its numbers are the ones ``exponential_noise`` computes for the
same seed, step and token. Checked here on fresh random triples every run, with
seeds above 2**32 (both halves of the seed count), steps up to 2**32, and both
of the sampler's paths: a row's candidate ids, and the whole vocabulary."""

from __future__ import annotations

import math
import random

import torch

from engine.sample.sampler import exponential_noise
from tests.conftest import ROOT, load_script

e24 = load_script(ROOT / "snippets" / "ch07" / "e24_shared_vs_counter_rng.py", "e24_rng")

ROWS, CANDIDATES, VOCAB = 16, 12, 300


def triples(seed: int) -> tuple[list[int], list[int], list[list[int]]]:
    rng = random.Random(seed)
    seeds = [rng.randrange(2**32) if r % 2 else rng.randrange(2**63) for r in range(ROWS)]
    steps = [rng.randrange(2**32) if r % 3 else rng.randrange(64) for r in range(ROWS)]
    ids = [rng.sample(range(VOCAB), CANDIDATES) for _ in range(ROWS)]
    return seeds, steps, ids


def reference(seed: int, step: int, token: int) -> float:
    """Exp(1) from Experiment 24's uniform, in float64."""
    return -math.log(e24.uniform(seed, step, token))


def test_noise_for_candidate_ids_is_experiment_24s() -> None:
    case = random.SystemRandom().randrange(2**32)
    seeds, steps, ids = triples(case)
    got = exponential_noise(torch.tensor(seeds), torch.tensor(steps), torch.tensor(ids), VOCAB)
    want = torch.tensor(
        [[reference(s, t, i) for i in row] for s, t, row in zip(seeds, steps, ids)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0, msg=f"case {case}")


def test_noise_over_the_whole_vocabulary_is_experiment_24s() -> None:
    case = random.SystemRandom().randrange(2**32)
    seeds, steps, _ = triples(case)
    got = exponential_noise(torch.tensor(seeds), torch.tensor(steps), None, VOCAB)
    want = torch.tensor(
        [[reference(s, t, i) for i in range(VOCAB)] for s, t in zip(seeds, steps)],
        dtype=torch.float64,
    )
    torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=0, msg=f"case {case}")


def test_the_high_half_of_a_seed_changes_the_stream() -> None:
    """Two seeds equal in their low 32 bits draw different noise: a key built from
    only one half would give them the same tokens."""
    low = random.SystemRandom().randrange(2**32)
    seeds = torch.tensor([low, low + 2**32, low + 2**62])
    noise = exponential_noise(seeds, torch.zeros(3, dtype=torch.int64), None, VOCAB)
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[1], noise[2])
