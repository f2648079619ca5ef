"""Success statistics of an evaluation: Wilson intervals and the unbiased pass@k estimator."""

from __future__ import annotations

import math

Z_95 = 1.959963984540054
"""Two-sided 95% normal quantile."""


def wilson_interval(successes: int, n: int, z: float = Z_95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default).

    Unlike the normal approximation it stays inside [0, 1] and is not degenerate at 0 or n
    successes, which matters for the few episodes per task an evaluation affords.

    Args:
        successes: Successful episodes, in [0, n].
        n: Episodes.
        z: Normal quantile of the confidence level.

    Returns:
        ``(low, high)``; ``(0.0, 1.0)`` when ``n`` is 0 (nothing is known).

    Raises:
        ValueError: ``successes`` is not in [0, n].
    """
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be in [0, n={n}], got {successes}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of the probability that at least one of ``k`` samples succeeds.

    ``1 - C(n - c, k) / C(n, k)`` from ``n`` samples of which ``c`` succeeded (Chen et al., 2021),
    computed as a product so it stays exact for large ``n``.

    Raises:
        ValueError: ``k`` is not in [1, n] or ``c`` is not in [0, n].
    """
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, n={n}], got {k}")
    if not 0 <= c <= n:
        raise ValueError(f"c must be in [0, n={n}], got {c}")
    if n - c < k:
        return 1.0
    failure = 1.0
    for i in range(n - c + 1, n + 1):
        failure *= 1.0 - k / i
    return 1.0 - failure


def pass_ks(k: int) -> list[int]:
    """The ``k`` values reported for ``k`` episodes per task: 1, the powers of two below ``k``, and ``k``."""
    values = {1, k}
    power = 2
    while power < k:
        values.add(power)
        power *= 2
    return sorted(values)


def difference_interval(s1: int, n1: int, s2: int, n2: int, z: float = Z_95) -> tuple[float, float]:
    """95% interval of ``s2/n2 - s1/n1`` for independent proportions (Newcombe's hybrid score method).

    Built from the two Wilson intervals (Newcombe 1998, method 10), so it behaves at 0% and 100%
    where the Wald interval collapses. Used for held-out success at the final version minus version 0.

    Raises:
        ValueError: Either sample is empty or a count is out of range.
    """
    if n1 == 0 or n2 == 0:
        raise ValueError("both samples need at least one trial")
    p1, p2 = s1 / n1, s2 / n2
    l1, u1 = wilson_interval(s1, n1, z)
    l2, u2 = wilson_interval(s2, n2, z)
    d = p2 - p1
    return d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2), d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
