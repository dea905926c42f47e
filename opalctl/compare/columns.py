"""What each figure of a paired comparison is, said once: the keys of ``statistics.paired`` (``--json``, and the
paired columns of ``--csv``) and the columns of the paired table that ``compare`` prints and the report page shows,
each with the words of its legend and the way its cell is written.

A cell is "-" only where its figure is undefined, and the legend says when that is (``UNDEFINED``); an infinite
d_z (every seed's difference the same and not zero) is written "+inf" or "-inf", never "-".
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opalctl.compare.significance import ALPHA, CONFIDENCE, EXACT_UP_TO, POWER, TEST_MIN_SEEDS

_LEVEL = f"p < {ALPHA:g}"
_POWER = f"{POWER * 100:.0f} % power"

# every key of a paired figure (statistics.paired), with what it is; --json and --csv carry them all
FIELDS: dict[str, str] = {
    "seeds": "the seeds both arms finished, which every figure is computed on",
    "unpaired": "the seeds only one side finished (baseline, arm), left out of every figure",
    "n": "how many seeds are paired",
    "baseline": "the baseline's value on each paired seed",
    "arm": "the arm's value on each paired seed",
    "differences": "arm - baseline on each paired seed",
    "mean_difference": "the mean of the differences; its sign is the metric's, so read it with higher_is_better",
    "ci_low": "the low end of the percentile bootstrap interval of the mean difference (over seeds, at confidence)",
    "ci_high": "the high end of the bootstrap interval",
    "confidence": f"the confidence of both intervals ({CONFIDENCE:g})",
    "resamples": "the bootstrap's resamples",
    "bootstrap_seed": "the seed of the bootstrap's generator, so the same records always give the same interval",
    "higher_is_better": "the metric's direction",
    "wins": "seeds on which the arm is better than the baseline",
    "ties": "seeds on which the two are exactly equal",
    "losses": "seeds on which the arm is worse",
    "p_value": f"the exact sign-flip test's two-sided p: no assumption about the distribution; the only p a verdict "
               f"claims a difference on (below {ALPHA:g}); its smallest value is 2 / 2^n, so below {TEST_MIN_SEEDS} "
               f"seeds it cannot reach {ALPHA:g}",
    "p_exact": f"whether p_value is exact (every sign assignment, up to {EXACT_UP_TO} seeds) or drawn at random",
    "interval_reliable": f"whether the bootstrap interval has enough seeds to mean something ({TEST_MIN_SEEDS} or "
                         f"more); with fewer it is far too narrow, use the t-interval",
    "detectable_effect": f"the smallest |mean difference| these n seeds, with the spread of their differences, "
                         f"detect by the paired t-test at {_LEVEL} with {_POWER}; null with fewer than two seeds "
                         f"or no spread",
    "seeds_needed": f"the seeds the exact test needs to detect the observed effect at {_LEVEL} with {_POWER}: at "
                    f"least {TEST_MIN_SEEDS} (the fewest whose exact p can reach {ALPHA:g}) and at least "
                    f"t_seeds_needed (a lower bound); {TEST_MIN_SEEDS} when every difference is the same; null when "
                    f"t_seeds_needed is",
    "note": "a sentence on what few seeds cannot say, or null",
    "sd_difference": "the sample standard deviation of the differences (n - 1); 0 when they agree to float "
                     "rounding; null for one seed",
    "d_z": "the standardised effect: mean_difference / sd_difference; null where it is undefined or infinite "
           "(t_note says which)",
    "t_statistic": "the paired t statistic, mean_difference / (sd_difference / sqrt(n))",
    "t_df": "the t-test's degrees of freedom, n - 1",
    "t_p_value": "the paired t-test's two-sided p; it assumes the differences are roughly normal, so it is "
                 "reported beside the exact test and never decides a verdict",
    "t_ci_low": "the low end of the Student t interval of the mean difference (n - 1 df, at confidence); the "
                "interval the tables and the verdict give",
    "t_ci_high": "the high end of the t-interval",
    "t_seeds_needed": f"the fewest seeds whose paired t-test detects the observed d_z at {_LEVEL} with {_POWER} "
                      f"(the noncentral t distribution's exact power); null when there is no effect to detect (d_z "
                      f"undefined, infinite or 0) or it would take more than a million seeds",
    "t_note": "why the t-test's figures are null (one seed, every difference zero, or every difference the same), "
              "or null",
    "verdict": "the sentence (compare adds it)",
}

# what "-" means in a cell of the table
UNDEFINED = ("- = undefined: one seed has no spread (no t-test, d_z or detectable); every difference the same has "
             "none either (d_z ±inf, no t p); a mean diff of 0, or a d_z too small for a million seeds, has no seeds "
             "figure")


def _number(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}"


def d_z_text(figure: dict[str, Any]) -> str:
    """d_z as a cell shows it: two decimals, "+inf" or "-inf" when every difference is the same, "-" when
    undefined."""
    if figure.get("d_z") is not None:
        return f"{figure['d_z']:+.2f}" if abs(figure["d_z"]) < 100 else f"{figure['d_z']:+.0f}"
    if figure.get("sd_difference") == 0.0 and figure.get("mean_difference"):
        return "+inf" if figure["mean_difference"] > 0 else "-inf"
    return "-"


def _interval(figure: dict[str, Any], digits: int) -> str:
    if figure.get("t_ci_low") is None:
        return "-"
    return f"[{figure['t_ci_low']:+.{digits}f}, {figure['t_ci_high']:+.{digits}f}]"


def _seeds(value: int | None) -> str:
    return "-" if value is None else str(value)


@dataclass(frozen=True)
class TableColumn:
    """One column of the paired table: its heading, the keys it shows, its legend and how its cell is written
    (from the figure and the number of decimals that suit the metric)."""

    header: str
    keys: tuple[str, ...]
    words: str
    cell: Callable[[dict[str, Any], int], str]


# the paired table is printed in two parts, to stay legible at 100 columns: the difference and the test that
# decides, then the effect size and the planning figures; the report page shows both parts in one table
DIFFERENCE: tuple[TableColumn, ...] = (
    TableColumn("mean diff", ("mean_difference",), "the mean over the paired seeds of arm - baseline",
                lambda f, d: _number(f["mean_difference"], d)),
    TableColumn("t interval", ("t_ci_low", "t_ci_high"),
                f"its {CONFIDENCE * 100:g} % Student t interval (n - 1 df; --json and --csv add a bootstrap one, far "
                f"too narrow below {TEST_MIN_SEEDS} seeds)", _interval),
    TableColumn("w/t/l", ("wins", "ties", "losses"), "seeds where the arm is better / equal / worse",
                lambda f, d: f"{f['wins']}/{f['ties']}/{f['losses']}"),
    TableColumn("exact p", ("p_value", "p_exact"),
                f"the sign-flip test's two-sided p, exact and assuming nothing (~: drawn at random, beyond "
                f"{EXACT_UP_TO} seeds); only it decides a verdict, and below {TEST_MIN_SEEDS} seeds it cannot reach "
                f"{ALPHA:g}", lambda f, d: _p(f["p_value"]) + ("" if f["p_exact"] else " ~")),
)
EFFECT: tuple[TableColumn, ...] = (
    TableColumn("d_z", ("d_z",), "mean diff / sd of the differences, the standardised effect",
                lambda f, d: d_z_text(f)),
    TableColumn("t p", ("t_p_value",), "the paired t-test's two-sided p, which assumes the differences are roughly "
                "normal; reported, never deciding", lambda f, d: _p(f.get("t_p_value"))),
    TableColumn("detectable", ("detectable_effect",),
                f"the smallest |mean diff| these seeds, with their spread, detect by the t-test ({_LEVEL}, {_POWER})",
                lambda f, d: "-" if f.get("detectable_effect") is None else f"{f['detectable_effect']:.{d}f}"),
    TableColumn("seeds t/exact", ("t_seeds_needed", "seeds_needed"),
                f"the seeds needed to detect the observed d_z ({_LEVEL}, {_POWER}) by the t-test (noncentral t) / by "
                f"the exact test (at least {TEST_MIN_SEEDS}, and at least the t-test's)",
                lambda f, d: f"{_seeds(f.get('t_seeds_needed'))}/{_seeds(f.get('seeds_needed'))}"),
)
TABLE = DIFFERENCE + EFFECT

# the report page's paired table: one cell per figure (heading, key of FIELDS), each with its exact value; w/t/l
# stands for wins, ties and losses
REPORT: tuple[tuple[str, str], ...] = (
    ("mean diff", "mean_difference"), ("t low", "t_ci_low"), ("t high", "t_ci_high"), ("w/t/l", "wins"),
    ("exact p", "p_value"), ("d_z", "d_z"), ("t p", "t_p_value"), ("detectable", "detectable_effect"),
    ("seeds t", "t_seeds_needed"), ("seeds exact", "seeds_needed"), ("bootstrap low", "ci_low"),
    ("bootstrap high", "ci_high"),
)


def legend() -> str:
    """The table's legend: each heading with what it is, then what "-" means."""
    return "; ".join(f"{column.header} = {column.words}" for column in TABLE) + "; " + UNDEFINED
