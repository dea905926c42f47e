"""How ``opalctl compare`` prints, legible at 100 columns: the arms, then the metrics (one row per metric, one
column per arm), then the paired figures (one row per arm and metric) with the legend of their columns
(``columns``), then the verdicts and notes in words.

Long metric names get short labels with a legend (``labels``); every sentence goes to stdout whole when piped and
wrapped to the terminal otherwise. Verdicts are printed for the primary metric and for every metric whose exact
test reached the level (a claim), or for each metric chosen with ``--metric``. A warning follows when the arms of
one seed trained under different concurrency (``concurrency``), and every flag an arm's runs raise
(``flags``: evaluation integrity, failed or hung programs, CPU spent outside the charged updates), each on its
own line and at the end of each of the arm's verdicts.
"""

from __future__ import annotations

from typing import Any

from opalctl import console
from opalctl.compare.columns import DIFFERENCE, EFFECT
from opalctl.compare.columns import legend as columns_legend
from opalctl.compare.concurrency import concurrency_warnings
from opalctl.compare.decisions import COUNTS, LEGEND
from opalctl.compare.labels import legend, short_labels
from opalctl.compare.significance import ALPHA, TEST_MIN_SEEDS


def _mean_spread(figure: dict | None, digits: int = 1) -> str:
    if not figure or figure.get("mean") is None:
        return "-"
    if figure["n"] > 1:
        return f"{figure['mean']:.{digits}f} ± {figure['std']:.{digits}f}"
    return f"{figure['mean']:.{digits}f}"


def _digits(figure: dict | None) -> int:
    """Decimals that show a metric: 1 for counts and large values, 4 for a small value like a loss."""
    if not figure or figure.get("mean") is None:
        return 1
    return 1 if abs(figure["mean"]) >= 10 else 4


def stage_words(stage: str | int) -> str:
    return {"selected": "selected models", "last": "last stages"}.get(stage, f"stage {stage}")


def render_compare(result: dict[str, Any], *, chosen: bool = False) -> None:
    """The whole printout; ``chosen`` when the metrics were picked with ``--metric`` (a verdict for each)."""
    labels = short_labels(list(result["metrics"]))
    _arms_table(result, labels)
    _agent_table(result)
    _metrics_table(result, labels)
    _paired_table(result, labels)
    _target_table(result)
    if legend(labels):
        console.paragraph("legend: " + legend(labels) + "; ↑ higher is better, ↓ lower is better")
    _sentences(result, chosen)
    for control in result.get("controls") or []:  # what each agent arm's programs amount to (compare/controls.py)
        console.paragraph("controls: " + control["sentence"])
    for warning in concurrency_warnings(result):
        console.paragraph("warning: " + warning)


def _arms_table(result: dict[str, Any], labels: dict[str, str]) -> None:
    rows = []
    for arm in result["arms"]:
        tta = arm["time_to_baseline"]
        reached = "-" if not tta else (f"{_mean_spread(tta['seconds'])} ({tta['reached']}/{tta['of']})"
                                       if tta["reached"] else f"never (0/{tta['of']})")
        rows.append([
            _shown(arm) + (" (baseline)" if arm["baseline"] else ""),
            f"{len(arm['seeds'])}" + (f" (+{len(arm['unfinished_seeds'])} unfinished)" if arm["unfinished_seeds"] else ""),
            _mean_spread(arm["updates"], 0),
            _mean_spread(arm[result["seconds_key"]]),
            _mean_spread(arm["promoted_stages"]),
            f"{arm['selected_anchor']}/{len(arm['seeds'])}",
            reached,
            _mean_spread(arm.get("outside_cpu_seconds")),
        ])
    seconds = "wall s" if result["seconds_key"] == "train_wall_seconds" else "cpu s"
    primary = labels.get(result["primary"], result["primary"])
    console.table(f"opalctl compare {result['lock']} (baseline {result['baseline']}, {stage_words(result['stage'])})",
                  ["arm", "seeds", "updates", f"train {seconds}", "promoted", "anchor kept",
                   f"s to base's {primary}", "cpu out s"], rows)


def _agent_table(result: dict[str, Any]) -> None:
    """The agent arms' decisions (counted over all their seeds, from the run folders: compare/decisions.py) and the
    seeds they acted on, then their waiting, cost and code seconds (mean over seeds); nothing when no arm has an
    agent: a fixed arm has no row, not a row of zeros."""
    arms = [arm for arm in result["arms"] if arm.get("decisions") and arm["agent"]]
    if not arms:
        return
    console.table("agent decisions, summed over seeds",
                  ["arm", *[key.replace("_", " ") for key in COUNTS], "acted on"],
                  [[arm["arm"], *[str(arm["decisions"]["total"][key]) for key in COUNTS],
                    f"{len(arm['decisions']['acted_seeds'])}/{len(arm['seeds'])}"] for arm in arms])
    console.paragraph("decisions: " + "; ".join(f"{key.replace('_', ' ')}: {LEGEND[key]}" for key in COUNTS)
                      + "; acted on: the seeds where at least one decision was applied")
    console.table("agent waiting and cost, mean over seeds", ["arm", "waiting s", "cost $", "code cpu s outside"],
                  [[arm["arm"], f"{arm['agent']['waiting_seconds']['mean']:.1f}",
                    f"{arm['agent']['cost_usd']['mean']:.2f}",
                    _mean_spread(arm["agent"].get("code_outside_cpu_seconds"), 2)] for arm in arms])


def _metrics_table(result: dict[str, Any], labels: dict[str, str]) -> None:
    rows = []
    for metric, direction in result["metrics"].items():
        figures = [arm["metrics"].get(metric) for arm in result["arms"]]
        digits = max(_digits(f) for f in figures)
        rows.append([f"{labels[metric]} {'↑' if direction == 'higher' else '↓'}",
                     *[_mean_spread(f, digits) for f in figures]])
    console.table(f"metrics of the {stage_words(result['stage'])}, mean ± sd over seeds",
                  ["metric", *[_shown(arm) for arm in result["arms"]]], rows)


def _paired_table(result: dict[str, Any], labels: dict[str, str]) -> None:
    """One row per arm and metric, in two parts (``columns.DIFFERENCE``, ``columns.EFFECT``), then the legend."""
    figures = [(arm, metric, figure) for arm in result["arms"] for metric, figure in arm["paired"].items()]
    if not figures:
        return
    for title, part, note in (
            (f"paired by seed against {result['baseline']} (exact: the sign-flip test, assumes nothing, decides)",
             DIFFERENCE, True),
            ("effect size and seeds needed (t: the paired t-test, assumes roughly normal differences)", EFFECT,
             False)):
        rows = []
        for arm, metric, figure in figures:
            digits = _digits(arm["metrics"].get(metric))
            cells = ["-" for _ in part] if figure["n"] == 0 else [column.cell(figure, digits) for column in part]
            rows.append([_shown(arm), labels[metric], *cells,
                         *([f"n={figure['n']}" if figure["n"] < TEST_MIN_SEEDS else ""] if note else [])])
        console.table(title, ["arm", "metric", *[column.header for column in part], *(["note"] if note else [])],
                      rows)
    console.paragraph("columns: " + columns_legend() + f"; note = n, the paired seeds, where below {TEST_MIN_SEEDS}")


def _target_table(result: dict[str, Any]) -> None:
    """Each arm's time-to-target (compare/target.py), where the protocol names a target: per seed, the median,
    and against the baseline the paired difference on the seeds both reached, with wins, ties and losses over every
    paired seed (not reached counted as infinite)."""
    target = result.get("target")
    if not target:
        return
    rows = []
    for arm in result["arms"]:
        figure = arm.get("time_to_target")
        if figure is None:
            continue
        pair = figure["paired"]
        rows.append([_shown(arm), " ".join(f"{s}:{target_time(t)}" for s, t in figure["seeds"].items()),
                     target_time(figure["median"]), f"{figure['reached']}/{figure['of']}",
                     *_target_pair_cells(pair)])
    sign = ">=" if target["direction"] == "higher" else "<="
    console.table(f"time to target {target['metric']} {sign} {target['value']:g} (budget charged, "
                  f"{result['clock']} clock)",
                  ["arm", "per seed", "median", "reached", "mean diff", "t interval", "exact p", "w/t/l all"], rows)
    console.paragraph("time to target: the budget charged at the first stage whose candidate reached the target, "
                      "from the evaluator's stage records; never = not reached (infinite); mean diff, t interval and "
                      "exact p on the seeds both the arm and the baseline reached (lower is better); w/t/l all: over "
                      "every paired seed, reaching beating not reaching")


def target_time(time: float | None) -> str:
    """A time-to-target as a cell shows it: the budget, or "never" for not reached."""
    return "never" if time is None else f"{time:g}"


def _target_pair_cells(pair: dict[str, Any] | None) -> list[str]:
    if pair is None:
        return ["", "", "", ""]
    counts = pair["all_seeds"]
    wtl = f"{counts['wins']}/{counts['ties']}/{counts['losses']}"
    if pair["n"] == 0:
        return ["-", "-", "-", wtl]
    interval = DIFFERENCE[1].cell(pair, 1)
    return [f"{pair['mean_difference']:+g}", interval, DIFFERENCE[3].cell(pair, 1), wtl]


def _sentences(result: dict[str, Any], chosen: bool) -> None:
    notes = sorted({f["note"] for arm in result["arms"] for f in arm["paired"].values() if f["note"]})
    for note in notes:
        console.paragraph("note: " + note)
    for arm in result["arms"]:
        for metric, figure in arm["paired"].items():
            if chosen or metric == result["primary"] or (figure["p_value"] is not None and figure["p_value"] < ALPHA):
                console.paragraph("verdict: " + figure["verdict"])
        if arm["anchor_note"]:
            console.paragraph("anchor: " + arm["anchor_note"])
        for flag in arm.get("flags") or []:
            console.paragraph(f"flagged: {arm['arm']}: {flag}")
        if arm.get("unconfined_note"):
            console.paragraph("note: " + arm["unconfined_note"])


def _shown(arm: dict[str, Any]) -> str:
    """An arm's name as the tables show it: a control lock's arm (opalctl control) marked post-hoc."""
    return arm["arm"] + (" (post-hoc)" if arm.get("post_hoc") else "")


def _count(mean: float) -> str:
    """A mean count over seeds: whole when it is (8), else with one decimal (1.3 applied of 8 asked, not 1)."""
    return f"{mean:.0f}" if abs(mean - round(mean)) < 1e-9 else f"{mean:.1f}"
