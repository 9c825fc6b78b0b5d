"""Goodness-of-fit helpers shared by the statistical tests.

The threshold is vLLM MRV2's `df + 10 * sqrt(2 * df)` (about ten standard deviations of a
chi-square with df degrees of freedom): a correct sampler fails it with probability far below
1e-9, while the negative controls in the tests sit many times above it.
"""
from __future__ import annotations

import math

import numpy as np


def chi_square(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0):
    """Pearson chi-square of counts against probabilities. Bins expected below `min_expected`
    are merged into one bin. Returns (statistic, degrees of freedom)."""
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    expected = probs * observed.sum()
    big = expected >= min_expected
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return math.inf, int(keep.sum()) - 1  # a count where the law puts no mass
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def chi_square_threshold(df: int) -> float:
    return df + 10.0 * math.sqrt(2.0 * df)


def assert_matches(observed: np.ndarray, expected_probs: np.ndarray, what: str = "sample"):
    stat, df = chi_square(observed, expected_probs)
    limit = chi_square_threshold(df)
    assert stat < limit, f"{what}: chi-square {stat:.1f} >= {limit:.1f} (df={df})"


def assert_differs(observed: np.ndarray, expected_probs: np.ndarray, what: str = "negative control"):
    """The negative control: a deliberately wrong sampler must fail the same test."""
    stat, df = chi_square(observed, expected_probs)
    limit = chi_square_threshold(df)
    assert stat >= limit, f"{what}: chi-square {stat:.1f} < {limit:.1f} (df={df}); the test has no power"
