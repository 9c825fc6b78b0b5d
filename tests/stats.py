"""Goodness-of-fit helpers shared by the statistical tests, with their power stated.

A test draws N samples and compares their counts with the law they must follow by Pearson's
chi-square over the law's bins, the bins expected below 5 draws merged into one (df = bins - 1). It
fails when the statistic reaches the chi-square quantile of false-alarm rate FALSE_ALARM (1e-7 per
assertion: a correct sampler fails a suite of a thousand such assertions once in ten thousand runs).

Power: N draws from a law p' at total-variation distance TV from the expected p (on the merged
bins) give a statistic distributed about as a noncentral chi-square with df degrees of freedom and
noncentrality lambda = N sum (p' - p)^2 / p >= 4 N TV^2 (Cauchy-Schwarz: (sum |p' - p|)^2 <=
sum (p' - p)^2 / p sum p). `detectable_tv(n, df)` is therefore the smallest TV that a test of N
draws and df degrees of freedom detects with probability >= POWER (0.99), whatever form the error
takes; `power(...)` is the probability of detecting a given wrong law (its exact lambda).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

FALSE_ALARM = 1e-7  # per assertion
POWER = 0.99
MIN_EXPECTED = 5.0  # bins expected below this many draws are merged into one


def merged(expected_probs: np.ndarray, n: int) -> np.ndarray:
    """The bins a test of n draws keeps as they are (a boolean mask); the others are merged into one."""
    probs = np.asarray(expected_probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    return probs * n >= MIN_EXPECTED


def merge(values: np.ndarray, big: np.ndarray) -> np.ndarray:
    """values [bins] -> the kept bins, then the sum of the others."""
    values = np.asarray(values, dtype=np.float64).ravel()
    return np.append(values[big], values[~big].sum())


def chi_square(observed: np.ndarray, expected_probs: np.ndarray):
    """Pearson chi-square of counts against probabilities, the bins expected below MIN_EXPECTED draws
    merged into one. Returns (statistic, degrees of freedom)."""
    n = float(np.sum(observed))
    big = merged(expected_probs, n)
    obs = merge(observed, big)
    exp = merge(np.asarray(expected_probs, dtype=np.float64).ravel() / np.sum(expected_probs), big) * n
    keep = exp > 0
    if (obs[~keep] > 0).any():
        return math.inf, int(keep.sum()) - 1  # a count where the law puts no mass
    obs, exp = obs[keep], exp[keep]
    return float(((obs - exp) ** 2 / exp).sum()), len(obs) - 1


def chi_square_threshold(df: int) -> float:
    """The statistic a correct sampler reaches with probability FALSE_ALARM."""
    return float(stats.chi2.isf(FALSE_ALARM, df))


def power(noncentrality: float, df: int) -> float:
    """The probability that a statistic of noncentrality lambda reaches the threshold (inf: draws where
    the law puts no mass, always detected)."""
    if math.isinf(noncentrality):
        return 1.0
    return float(stats.ncx2.sf(chi_square_threshold(df), df, noncentrality))


def detectable_tv(n: int, df: int) -> float:
    """The smallest total-variation error that a test of n draws over df + 1 bins detects with
    probability >= POWER (through lambda >= 4 n TV^2)."""
    lam = optimize.brentq(lambda x: power(x, df) - POWER, 1e-9, 1e7)
    return math.sqrt(lam / (4 * n))


def noncentrality(law: np.ndarray, expected_probs: np.ndarray, n: int) -> float:
    """lambda = n sum (law - p)^2 / p over the merged bins of a test of n draws: the statistic's mean
    less df when the draws follow `law` instead of p."""
    big = merged(expected_probs, n)
    p = merge(np.asarray(expected_probs, dtype=np.float64).ravel() / np.sum(expected_probs), big)
    wrong = merge(np.asarray(law, dtype=np.float64).ravel() / np.sum(law), big)
    keep = p > 0
    if (wrong[~keep] > 0).any():
        return math.inf
    return float(n * ((wrong[keep] - p[keep]) ** 2 / p[keep]).sum())


@dataclass
class Design:
    """What a test of n draws against a law states: its degrees of freedom, threshold and the
    smallest total-variation error it detects with probability POWER."""
    n: int
    df: int
    threshold: float
    detectable_tv: float

    def __str__(self) -> str:
        return (f"N={self.n}, df={self.df}, threshold {self.threshold:.1f}, detects TV >= "
                f"{self.detectable_tv:.4f} with probability {POWER}")


def design(expected_probs: np.ndarray, n: int) -> Design:
    """The Design of a test of n draws against `expected_probs` (known before drawing)."""
    big = merged(expected_probs, n)
    p = merge(np.asarray(expected_probs, dtype=np.float64).ravel(), big)
    df = int((p > 0).sum()) - 1
    return Design(n, df, chi_square_threshold(df), detectable_tv(n, df))


def assert_matches(observed: np.ndarray, expected_probs: np.ndarray, what: str = "sample",
                   detects: float | None = None) -> float:
    """The counts follow the law: the statistic stays below the threshold. `detects`: the test's design
    must detect a total-variation error this large with probability POWER. Returns the statistic."""
    if detects is not None:
        plan = design(expected_probs, int(np.sum(observed)))
        assert plan.detectable_tv <= detects, f"{what}: {plan}, not {detects}"
    stat, df = chi_square(observed, expected_probs)
    limit = chi_square_threshold(df)
    assert stat < limit, (f"{what}: chi-square {stat:.1f} >= {limit:.1f} (df={df}; "
                          f"{design(expected_probs, int(np.sum(observed)))})")
    return stat


def assert_differs(observed: np.ndarray, expected_probs: np.ndarray, what: str = "negative control") -> float:
    """The negative control: a deliberately wrong sampler fails the same test. Returns the statistic."""
    stat, df = chi_square(observed, expected_probs)
    limit = chi_square_threshold(df)
    assert stat >= limit, f"{what}: chi-square {stat:.1f} < {limit:.1f} (df={df}); the test has no power"
    return stat
