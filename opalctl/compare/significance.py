"""How much a handful of seeds can say: the exact paired test, the smallest detectable effect, the seeds needed.

The test is the sign-flip permutation test of the paired differences: if an arm made no difference, each seed's
difference was as likely to come out with the other sign, so the observed |sum| is compared with the |sum| under
every assignment of signs. With few seeds every assignment is enumerated (``EXACT_UP_TO``), so the p-value is
exact and nothing is assumed about the distribution. Its smallest possible value is 2 / 2^n (the observed signs
and their mirror image), which is why fewer than ``TEST_MIN_SEEDS`` seeds can never reach ``ALPHA``: a fact the
verdict states rather than hides.

The detectable effect and the seeds needed use the normal approximation of a paired test at ``ALPHA`` with
``POWER`` (the spread of the differences taken from the seeds at hand), floored at ``TEST_MIN_SEEDS``; they are
planning figures, said "about" wherever they are printed.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

ALPHA = 0.05  # the two-sided level a verdict calls a difference at
POWER = 0.8  # the chance of detecting the effect that the planning figures aim for
EXACT_UP_TO = 16  # seeds up to which every sign assignment is enumerated (2^16 rows)
RANDOM_FLIPS = 20_000  # sign assignments drawn beyond that, from a seeded generator
# the fewest seeds whose exact test can reach ALPHA at all: the smallest p is 2 / 2^n
TEST_MIN_SEEDS = next(n for n in range(1, 64) if 2.0 ** (1 - n) < ALPHA)
_TOLERANCE = 1e-9  # relative: sums equal up to float rounding count as "as extreme"


def sign_flip_p(differences: list[float], seed: int = 0) -> tuple[float | None, bool]:
    """The two-sided p-value of the sign-flip test and whether it is exact; (None, True) with no difference.

    Exact for up to ``EXACT_UP_TO`` differences; beyond, ``RANDOM_FLIPS`` assignments from a seeded generator
    with the observed one counted in, so p is never 0."""
    n = len(differences)
    if n == 0:
        return None, True
    data = np.asarray(differences, dtype=np.float64)
    observed = abs(float(data.sum()))
    limit = observed - _TOLERANCE * max(1.0, float(np.abs(data).sum()))
    if n <= EXACT_UP_TO:
        bits = (np.arange(2 ** n, dtype=np.int64)[:, None] >> np.arange(n, dtype=np.int64)) & 1
        sums = np.abs((1 - 2 * bits) @ data)
        return float(np.count_nonzero(sums >= limit)) / float(2 ** n), True
    signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0]), size=(RANDOM_FLIPS, n))
    extreme = int(np.count_nonzero(np.abs(signs @ data) >= limit))
    return (extreme + 1) / (RANDOM_FLIPS + 1), False


def _z_total() -> float:
    normal = NormalDist()
    return normal.inv_cdf(1.0 - ALPHA / 2.0) + normal.inv_cdf(POWER)


def detectable_effect(differences: list[float]) -> float | None:
    """The smallest mean difference these seeds' spread would detect (at ``ALPHA``, with ``POWER``); None when
    no result of this many seeds can reach ``ALPHA`` or the spread is unknown (one seed)."""
    n = len(differences)
    if n < TEST_MIN_SEEDS:
        return None
    spread = float(np.std(np.asarray(differences, dtype=np.float64), ddof=1))
    return _z_total() * spread / math.sqrt(n)


def seeds_needed(differences: list[float]) -> int | None:
    """About how many seeds would detect a mean difference of the observed size with the observed spread;
    None when there is nothing to detect (mean 0) or the spread is unknown (fewer than two seeds)."""
    n = len(differences)
    if n < 2:
        return None
    data = np.asarray(differences, dtype=np.float64)
    mean, spread = float(data.mean()), float(data.std(ddof=1))
    if mean == 0.0:
        return None
    return max(TEST_MIN_SEEDS, math.ceil((_z_total() * spread / abs(mean)) ** 2))
