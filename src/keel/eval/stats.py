"""The statistics the eval reports: Wilson intervals for pass rates, McNemar's exact test for paired
differences between two runs over the same items."""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the two-sided 95% normal quantile


def wilson_interval(passed: float, n: int, z: float = Z95) -> tuple[float, float]:
    """95% Wilson score interval of a pass rate: sensible at 0/n and n/n and for small n, where the
    normal approximation gives intervals outside [0, 1]."""
    if n == 0:
        return (0.0, 1.0)
    p = passed / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mcnemar_p(gained: int, lost: int) -> float:
    """Two-sided exact McNemar p-value: of the items the two runs disagree on, `gained` passed only
    in the candidate and `lost` only in the baseline; under "no difference" each discordant item is
    a fair coin, so the p-value is the binomial tail of the rarer outcome, doubled."""
    n = gained + lost
    if n == 0:
        return 1.0
    k = min(gained, lost)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2**n
    return min(1.0, 2 * tail)
