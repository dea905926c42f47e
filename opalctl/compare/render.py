"""How ``opalctl compare`` prints: one row per arm, then one row per arm and metric for the paired figures."""

from __future__ import annotations

from typing import Any

from opalctl import console


def _mean_spread(figure: dict | None, digits: int = 1) -> str:
    if not figure or figure.get("mean") is None:
        return "-"
    if figure["n"] > 1:
        return f"{figure['mean']:.{digits}f} ± {figure['std']:.{digits}f}"
    return f"{figure['mean']:.{digits}f}"


def render_compare(result: dict[str, Any]) -> None:
    rows = []
    for arm in result["arms"]:
        tta = arm["time_to_baseline"]
        reached = "-" if not tta else (f"{_mean_spread(tta['seconds'])} s ({tta['reached']}/{tta['of']})"
                                       if tta["reached"] else f"never (0/{tta['of']})")
        agent = arm["agent"]
        rows.append([
            arm["arm"] + (" (baseline)" if arm["baseline"] else ""),
            f"{len(arm['seeds'])}" + (f" (+{len(arm['unfinished_seeds'])} unfinished)" if arm["unfinished_seeds"] else ""),
            _mean_spread(arm["updates"], 0),
            _mean_spread(arm[result["seconds_key"]]),
            _mean_spread(arm["promoted_stages"]),
            f"{arm['selected_anchor']}/{len(arm['seeds'])}",
            *[_mean_spread(arm["metrics"].get(m)) for m in result["metrics"]],
            reached,
            "-" if not agent else ("/".join(_count(agent[key]["mean"]) for key in
                                            ("decisions_asked", "decisions_applied", "decisions_reverted"))
                                   + f", {agent['waiting_seconds']['mean']:.1f} s, ${agent['cost_usd']['mean']:.2f}"),
        ])
    seconds = "wall s" if result["seconds_key"] == "train_wall_seconds" else "cpu s"
    console.table(f"opalctl compare {result['lock']} (baseline {result['baseline']})",
                  ["arm", "seeds", "updates", f"train {seconds}", "promoted", "anchor kept", *result["metrics"],
                   f"time to baseline's final {result['primary']}", "agent asked/applied/reverted, waiting, cost"], rows)
    paired_rows = []
    for arm in result["arms"]:
        for metric, figure in arm["paired"].items():
            if figure["n"] == 0:
                paired_rows.append([arm["arm"], metric, "-", "-", "-", figure.get("note") or "no common seed"])
                continue
            paired_rows.append([
                arm["arm"], metric, f"{figure['mean_difference']:+.2f}",
                f"[{figure['ci_low']:+.2f}, {figure['ci_high']:+.2f}]",
                f"{figure['wins']}/{figure['ties']}/{figure['losses']}",
                ", ".join(f"{s}: {d:+g}" for s, d in zip(figure["seeds"], figure["differences"])),
            ])
    if paired_rows:
        console.table(f"paired by seed against {result['baseline']} (selected models, 95 % bootstrap interval)",
                      ["arm", "metric", "mean diff", "interval", "wins/ties/losses", "per seed"], paired_rows)


def _count(mean: float) -> str:
    """A mean count over seeds: whole when it is (8), else with one decimal (1.3 applied of 8 asked, not 1)."""
    return f"{mean:.0f}" if abs(mean - round(mean)) < 1e-9 else f"{mean:.1f}"
