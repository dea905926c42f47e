"""The time-to-target table of a page (``opalctl report``'s and ``opalctl suite report``'s): each arm's time per
seed, its median and the paired figures against the baseline, as ``compare`` computes them (compare/target.py).
Nothing where the protocol names no target."""

from __future__ import annotations

from typing import Any

from opalctl.report import html


def target_table(result: dict[str, Any], heading: str = "h3") -> str:
    target = result.get("target")
    if not target:
        return ""
    rows = []
    for arm in result["arms"]:
        figure = arm.get("time_to_target")
        if figure is None:
            continue
        pair = figure["paired"] or {}
        counts = pair.get("all_seeds")
        rows.append([f"<td>{html.text(arm['arm'])}{' (baseline)' if arm['baseline'] else ''}</td>",
                     f"<td>{html.text(' '.join(f'{s}: {_time(t)}' for s, t in figure['seeds'].items()))}</td>",
                     _time_cell(figure["median"], arm["arm"], "median"),
                     f"<td>{figure['reached']} of {figure['of']}</td>",
                     html.number_cell(pair.get("mean_difference"), arm=arm["arm"], field="target_mean_difference"),
                     html.number_cell(pair.get("t_ci_low"), arm=arm["arm"], field="target_t_ci_low"),
                     html.number_cell(pair.get("t_ci_high"), arm=arm["arm"], field="target_t_ci_high"),
                     html.number_cell(pair.get("p_value"), arm=arm["arm"], field="target_p_value"),
                     "<td></td>" if counts is None else
                     f"<td>{counts['wins']}/{counts['ties']}/{counts['losses']}</td>"])
    sign = "≥" if target["direction"] == "higher" else "≤"
    return (f"<{heading}>Time to target: {html.text(target['metric'])} {sign} {html.text(target['value'])} "
            f"(budget charged, {html.text(result['clock'])} clock)</{heading}>"
            + html.table(["arm", "per seed", "median", "reached", "mean diff", "t low", "t high", "exact p",
                          "w/t/l all seeds"], rows, cells_ready=True)
            + html.paragraphs(["The budget charged at the first stage whose candidate (its checkpoint, promoted or "
                               "not) reached the target, from the evaluator's stage records; never: not reached, an "
                               "infinite time. The paired figures are on the seeds both the arm and the baseline "
                               "reached (lower is better); w/t/l counts every paired seed, reaching beating not "
                               "reaching."], "muted"))


def _time(time: float | None) -> str:
    return "never" if time is None else html.shown_number(time)


def _time_cell(time: float | None, arm: str, field: str) -> str:
    if time is None:
        return f'<td class="n" data-arm="{html.text(arm)}" data-field="target_{field}">never</td>'
    return html.number_cell(time, arm=arm, field=f"target_{field}")
