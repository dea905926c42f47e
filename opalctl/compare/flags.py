"""What an arm's runs flag about themselves, so that no verdict is read without it: pure functions of the reports.

A verdict compares the selected models' metrics; it cannot see how the arm got there. These are the facts of its
runs that a reader must have before believing a difference, each said with the seeds it happened on:

- **evaluation integrity**: a program moved the parameters for an evaluation and back (report.json's
  ``agent.eval_integrity.flagged``): the stage metrics of that run describe weights it did not train with;
- **failed or hung programs**: versions the agent wrote that failed (an exception, a non-finite step, a state that
  could not be saved) or hung, and were reverted (``agent.decisions_reverted``, and ``hung`` versions read from
  the run's ``hung.jsonl``): what the agent arm trained with is partly its fallback's;
- **non-finite results**: a run that diverged (report.json's ``nonfinite_losses``, ``parameter_change.nonfinite``,
  stage metrics recorded as null): its non-finite metrics are left out of the figures, so the seeds a figure
  pairs may be fewer than the arm's;
- **work outside the charged updates**: the CPU the kernel counted for the training process (``process``, read by
  the evaluator from outside it) less the CPU of its charged updates, against the baseline's on the same seed. An
  agent's program can run anything in the training process; whatever it does outside the timed updates is not in
  the budget, so an arm whose training process spent clearly more there than the baseline's (more than
  ``OUTSIDE_SLACK_SECONDS`` and more than its own charged training CPU) did work the comparison does not count.

And one note that is no flag: an agent arm whose training process ran without the operating system's confinement
(no Landlock, or a run started from Python rather than ``opalctl run``): its records of results were not protected
from its programs (README, "What an agent program can and cannot do").
"""

from __future__ import annotations

from typing import Any

OUTSIDE_SLACK_SECONDS = 1.0  # CPU seconds outside the charged updates an arm may spend beyond the baseline's


def outside_cpu(report: dict[str, Any]) -> float | None:
    """CPU seconds the kernel counted for the run's training process beyond its charged updates' (None when the
    kernel's count is not in the report)."""
    process = report.get("process") or {}
    measured = process.get("cpu_seconds")
    if not isinstance(measured, (int, float)):
        return None
    return max(0.0, float(measured) - float(report["seconds"]["train_cpu"]))


def _seeds(seeds: list[int]) -> str:
    return ("seed " if len(seeds) == 1 else "seeds ") + ", ".join(map(str, seeds))


def run_flags(reports: dict[int, dict[str, Any]], hung: dict[int, int]) -> list[str]:
    """The flags an arm's own runs raise (seed -> report; seed -> versions that hung), as clauses."""
    out = []
    integrity = sorted(seed for seed, report in reports.items()
                       if ((report.get("agent") or {}).get("eval_integrity") or {}).get("flagged"))
    if integrity:
        out.append(f"evaluation integrity: a program moved the parameters for an evaluation and back on "
                   f"{_seeds(integrity)}, so those stage metrics are not of the weights it trained")
    reverted = {seed: (report.get("agent") or {}).get("decisions_reverted") or 0 for seed, report in reports.items()}
    failed = sorted(seed for seed, count in reverted.items() if count)
    if failed:
        total = sum(reverted[seed] for seed in failed)
        out.append(f"{total} program version(s) failed and were reverted on {_seeds(failed)}")
    diverged = {seed: _diverged(report) for seed, report in reports.items()}
    diverged = {seed: said for seed, said in diverged.items() if said}
    if diverged:
        out.append(f"non-finite results ("
                   f"{'; '.join(f'seed {seed}: {said}' for seed, said in sorted(diverged.items())[:3])}): a "
                   f"diverged run is a result, and its metrics that are not finite are left out of the figures")
    hanging = sorted(seed for seed, count in hung.items() if count)
    if hanging:
        out.append(f"{sum(hung[seed] for seed in hanging)} program version(s) hung on {_seeds(hanging)} (the run "
                   f"ended and was resumed without them)")
    return out


def _diverged(report: dict[str, Any]) -> str:
    """What in one run's report was not finite (its training losses, final weights, stage metrics), or ""."""
    said = []
    losses = report.get("nonfinite_losses")
    if isinstance(losses, int) and losses:
        said.append(f"{losses} update(s) with a non-finite loss")
    if ((report.get("parameter_change") or {}).get("nonfinite")):
        said.append("final weights not finite")
    stages = [stage.get("stage") for stage in report.get("stages") or []
              if isinstance(stage, dict) and None in (stage.get("metrics") or {}).values()]
    if stages:
        said.append(f"metrics not finite at stage(s) {', '.join(map(str, stages))}")
    return ", ".join(said)


def outside_work_flag(reports: dict[int, dict[str, Any]], baseline: dict[int, dict[str, Any]]) -> str | None:
    """The flag of an arm whose training process spent clearly more CPU outside its charged updates than the
    baseline's on the same seed (module docstring), or None."""
    heavy = []
    for seed in sorted(set(reports) & set(baseline)):
        mine, theirs = outside_cpu(reports[seed]), outside_cpu(baseline[seed])
        if mine is None or theirs is None:
            continue
        excess = mine - theirs
        if excess > max(OUTSIDE_SLACK_SECONDS, float(reports[seed]["seconds"]["train_cpu"])):
            heavy.append((seed, excess))
    if not heavy:
        return None
    worst = max(excess for _, excess in heavy)
    return (f"work outside the charged updates: its training process spent up to {worst:.1f} CPU-s more outside "
            f"them than the baseline's on {_seeds([seed for seed, _ in heavy])} (counted by the kernel), which the "
            f"budget did not charge")


def unconfined_note(arm: str, reports: dict[int, dict[str, Any]]) -> str | None:
    """One sentence when an agent arm's training process ran without the operating system's confinement."""
    bare = sorted(seed for seed, report in reports.items() if report.get("agent") is not None and
                  "confinement" in report and (report["confinement"] or {}).get("mechanism") in (None, "none"))
    if not bare:
        return None
    return (f"{arm}'s training process ran without the operating system's confinement on {_seeds(bare)}, so its "
            f"records of results were not protected from its agent's programs")
